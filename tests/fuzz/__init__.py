"""Fuzz harness for kapc's input boundaries (prior.json, .kap, .kapb, pipelines). See README.md."""
