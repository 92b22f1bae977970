"""The commands that are not DVC stages: ``cellpath plan``, ``cellpath export`` and ``cellpath encoders``.
Like the stages they sit on top of the domain packages: each reads its inputs, calls the domain code
and prints or writes its outputs; no domain package imports them."""
