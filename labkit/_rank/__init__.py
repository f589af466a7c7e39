"""What runs inside a rank, or a torchrun agent, before the learner's script: the rank side.

Owns:
    entry      a rank's entry point (``python -m labkit._rank.entry SCRIPT``): pid file, watcher
               thread, error file, then the script as ``__main__``
    sigterm    a rank's SIGTERM: its last metrics lines kept, a rank already ending left to end
    agent      a torchrun agent that dies with its kernel (``python -m labkit._rank.agent``)
    agent_server  one per launching kernel: imports torch once, then forks each agent warm
               (``python -m labkit._rank.agent_server``; Linux)
    zygote     one per agent: a copy of it, torch loaded, that forks each of its ranks warm
    forkserver both servers' protocol: fork on request, report each exit; the asking side
    proc       process tokens: is a pid still the process it was (the launcher, a rank)?
    layout     which node and local rank a rank is, written to the run folder (several nodes)
    selftest   the tiny all-reduce script ``labkit.doctor(launch=True)`` launches (a script,
               not imported: it loads torch as any lesson script does)
    collectives  the script ``labkit.bandwidth`` launches: all-reduce, all-gather and
               reduce-scatter timed over sizes (a script too: it loads torch)
    probe      what ``labkit.preflight`` runs on every node (``python -m labkit._rank.probe``):
               versions, interfaces, the rendezvous port held or reached, a checkpoint token

Imported by: every rank and agent before the script (and torch) loads, so **standard library
only** (``tests/test_layout.py`` imports each module in a fresh interpreter and checks); the
kernel's launcher (``labkit._launch``) reads their constants and tokens.
"""
