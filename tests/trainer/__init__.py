"""The trainer: elastic training, warm restarts, health, data, configuration."""
