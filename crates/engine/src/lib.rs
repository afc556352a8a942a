//! ferrotron-engine
