//! ferrotron-plan
