"""Helpers shared by the training recipes. Each module has one job; the training loops live in the scripts."""
