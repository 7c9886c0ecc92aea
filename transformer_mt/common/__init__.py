"""What every stage shares, knowing nothing of models or runs: exit codes and the error a user
can act on (exits), file primitives and tmt's file names (files), fault points for tests (faults),
the allocator setting (allocator), the one table of language codes (languages), text in and out
(textio), process groups under torchrun (distributed).

Imports: nothing of tmt but this wing.
"""
