"""The window: its declared state (`spec`), a micro-step (`step`), its
close (`close`), its counts (`counts`) and its saving (`restore`)."""
