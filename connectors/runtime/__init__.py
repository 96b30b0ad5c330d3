"""The services that host the core: the processor, the timer service, the scanner."""
