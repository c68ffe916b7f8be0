"""The one way down from every front end: the request loop, prompt encoding, the run record and its statistics."""
