"""The torch-free protocol between a job's processes and gpuflex: the store's keys and
exit codes, the worker environment contract, record signing, the control socket, the run
directory's files, failpoints, checks of values read from outside, log set-up and the
stop/checkpoint flags. The control side imports only this sub-package of gpuflex.elastic."""
