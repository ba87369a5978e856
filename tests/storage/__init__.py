"""The storage backends: conformance, retries, object stores, locks, hostile roots."""
