"""``tpflex-train``: standalone NTP training of a Hugging Face model on this machine (no
controller), with a schedule of layout changes. See docs/models.md."""
