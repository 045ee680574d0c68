"""What travels, with no I/O: settings, keys, records, the wire format, entries, input lines,
sampling, errors."""
