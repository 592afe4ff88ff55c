"""Where ranks come from: ``simulate`` (N ranks in one process: LocalTensorMode and the fake process group)
and ``launch`` (N real gloo processes, with failures reported per rank).

May import: ``shardings.spec``.
"""
