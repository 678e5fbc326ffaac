//! The hardware provider over rdma-mummy-sys (in progress; enable with the `ibverbs` feature once it lands).
