//! The bytes a rank sent in each parallel dimension, beside the plan's: [`CommByDim`], a
//! value per dimension keyed by it. The mesh fills it each step (`Mesh::take_comm_bytes`) and
//! the trainer's metrics carry it (`StepMetrics.comm`, written as `"comm": {"tp": …}`), so a
//! new dimension adds its entry here, not a field to the metrics.

use ferrotron_plan::cluster::Dim;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One dimension's bytes sent this step, and the planner's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommBytes {
    pub sent: u64,
    pub planned: u64,
}

/// A value per parallel dimension, in `Dim::ALL`'s order: a map keyed by the dimension that
/// allocates nothing (the metrics of every step are kept for the run's summary, inside the
/// measured memory), written in JSON as `{"tp": …, "dp": …}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CommByDim([Option<CommBytes>; 5]);

/// `d`'s place in `Dim::ALL`.
pub fn dim_index(d: Dim) -> usize {
    Dim::ALL
        .iter()
        .position(|&x| x == d)
        .expect("every Dim is in Dim::ALL")
}

impl CommByDim {
    pub fn get(&self, d: Dim) -> Option<CommBytes> {
        self.0[dim_index(d)]
    }

    pub fn insert(&mut self, d: Dim, c: CommBytes) {
        self.0[dim_index(d)] = Some(c);
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(Option::is_none)
    }

    /// The dimensions with a value, in `Dim::ALL`'s order.
    pub fn iter(&self) -> impl Iterator<Item = (Dim, CommBytes)> + '_ {
        (Dim::ALL.iter().zip(&self.0)).filter_map(|(d, c)| Some((*d, (*c)?)))
    }
}

impl Serialize for CommByDim {
    fn serialize<Ser: serde::Serializer>(&self, s: Ser) -> Result<Ser::Ok, Ser::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        for (d, c) in self.iter() {
            m.serialize_entry(d.name(), &c)?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for CommByDim {
    fn deserialize<De: serde::Deserializer<'de>>(d: De) -> Result<Self, De::Error> {
        let named = BTreeMap::<String, CommBytes>::deserialize(d)?;
        let mut out = CommByDim::default();
        for (name, c) in named {
            let Some(dim) = Dim::ALL.into_iter().find(|d| d.name() == name) else {
                let dims: Vec<_> = Dim::ALL.iter().map(|d| d.name()).collect();
                return Err(serde::de::Error::custom(format!(
                    "comm: unknown dimension {name:?} (one of {})",
                    dims.join(", ")
                )));
            };
            out.insert(dim, c);
        }
        Ok(out)
    }
}
