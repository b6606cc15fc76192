"""The worker side: engines, the worker process and its command-line entry point."""
