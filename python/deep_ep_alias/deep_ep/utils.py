"""``deep_ep.utils``: the event helpers frameworks import from there."""

from moelink import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
