"""The relay: requests to engines and answers back, passthrough or translated, in the caller's dialect."""
