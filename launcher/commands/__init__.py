"""One module per command: each exports register(subparsers), which sets `handler`."""
