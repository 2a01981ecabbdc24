"""Helpers the tests share (not tests): a fixed corpus, a rank launcher, forced interleavings, training runs."""
