"""The formats both sides share: the HTTP API's bodies (protocol), sampling requests and samples, weight buckets and
version folders, and the collective weight-sync wire."""
