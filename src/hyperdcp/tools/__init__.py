"""Offline operations on sources (verify, inspect, diff, convert); no process group needed."""
