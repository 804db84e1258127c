"""Patching: the lock (what to clone), the series (what to apply), git plumbing, the checkout, rebase."""
