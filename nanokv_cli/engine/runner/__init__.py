"""Execution: the run plan, the K/V tensor, forward passes, attention back ends, sampling."""
