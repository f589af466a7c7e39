"""Diagnosing: where a rank is, what it called, where a step's time went, what a seat offers.

Owns:
    stacks   every "where is a rank" format (faulthandler, py-spy, tracebacks), parsed once,
             said in one form; the excerpt of a dump a cell shows
    hang     ``dump_stack``, ``py_spy_dump``: a hung rank's stack read from outside (lesson 10)
    flight   ``flight_records``: every rank's flight-recorder dump in one table (lesson 10)
    trace    ``read_trace``, ``overlap_ms``, ``plot_timeline``: a torch.profiler trace (lesson 07)
    profile  ``step_events``, ``allreduce_bytes``, ``powersgd_numbers``: one DDP step taken apart
             from its trace (lesson 07)
    doctor   ``doctor``: the seat check (lesson 00, ``make doctor``)
    bandwidth  ``bandwidth``: collectives' algorithm and bus bandwidth over sizes, the
             alpha-beta model fitted to them (lesson 07)
    ring     ``AlphaBeta``: that model of a ring collective, its bus factors and its fit
    preflight  ``preflight``: before a launch on several nodes, what will break (lesson 09,
             ``make doctor NODES=2``); ``findings`` says what the nodes' probes found

Imported by the kernel: the public names above, and the launcher (``stacks``, on a timeout).
"""
