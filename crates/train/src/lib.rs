//! ferrotron-train
