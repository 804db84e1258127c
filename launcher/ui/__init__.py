"""`python -m launcher ui`: a local web page over the launcher's own files and commands."""
