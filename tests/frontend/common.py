"""Constants shared by the frontend tests."""

# A few HotpotQA dev questions (comparison and bridge) and targets from 1K to 8K tokens.
QUESTIONS = (0, 1, 7)
TARGETS = (1024, 2048, 4096, 8192)
