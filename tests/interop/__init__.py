"""Other formats in and out: DCP directories and Hugging Face folders."""
