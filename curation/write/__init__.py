"""The write step: webdataset shards, decisions and the manifest."""
