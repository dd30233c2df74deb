"""Runtime: bucket buffers, the CPU optimizer worker, handles and event logs."""
