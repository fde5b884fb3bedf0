"""Rules for the mixture-of-experts routing ops (filled in below)."""
