"""Helpers the tests share (no tests): a fixed corpus, a rank launcher, forced interleavings, train runs."""
