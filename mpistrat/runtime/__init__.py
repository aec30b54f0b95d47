"""The MPI substrate every layer above stands on.

- ``_mpi``: lazy access to ``mpi4py.MPI`` (importing it initialises MPI);
- ``_commcache``: state cached on a communicator and freed with it;
- ``topology``: node groups of a communicator (who shares a node, who leads it);
- ``devices``: which GPUs a rank uses;
- ``shared``: arrays in MPI-3 shared windows that every rank of a node can read;
- ``agreement``: one small collective that checks a call is valid and identical everywhere;
- ``stall``: stall reports and timeouts for mpistrat's collectives.

Nothing here imports the algorithms, the engine or the strategies; importing this package
initialises nothing.
"""
