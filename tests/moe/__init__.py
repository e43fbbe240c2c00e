"""Tests of the mixture-of-experts layer and expert parallelism (issue #28)."""
