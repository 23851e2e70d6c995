"""Tasks shipped with the project: prompts plus a gold (verifiable) reward function."""
