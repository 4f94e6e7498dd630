"""Measurements that print ratios taken side by side in one run."""
