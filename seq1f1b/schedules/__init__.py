"""The Seq1F1B schedules: cutting a step into (sample, segment) units, their losses and
receives, the split of each sequence, and the schedule classes on torch's runtime."""
