"""What a user runs: the command line (`cli`), the run driver (`train`), pre-flight checks (`fit`), the
files a run owns (`layout`), metrics, progress and plots (`metrics`)."""
