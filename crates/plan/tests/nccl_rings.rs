//! Data-parallel rings across nodes: NCCL runs one ring per network card, so a group with k
//! members in a node drives k cards (bounded by NVLink); one member per node drives one.

use ferrotron_plan::cluster::{gpu, replica_group, Cluster};
use ferrotron_plan::*;

const GB: f64 = 1e9;

fn h100() -> Cluster {
    Cluster::of(gpu("h100").unwrap(), 8).unwrap()
}

fn ring_bw(tp: u64, dp: u64) -> f64 {
    let c = h100();
    let l = Layout {
        tp,
        dp,
        ..Layout::default()
    };
    c.ring_link(&replica_group(&l, c.gpus_per_node)).bw
}

#[test]
fn members_per_node_set_the_cards_a_ring_drives() {
    let c = h100();
    // ib-ndr: 400 Gb/s = 50 GB/s per card; NVLink 4: 450 GB/s; collectives at 80%.
    assert_eq!(c.network.bw, 50.0 * GB);
    let eff = c.link_efficiency;
    // dp 16 over two nodes: 8 members per node, 8 cards, 400 GB/s < NVLink.
    assert!((ring_bw(1, 16) - 8.0 * 50.0 * GB * eff).abs() < 1.0);
    // tp 2: 4 members per node.
    assert!((ring_bw(2, 8) - 4.0 * 50.0 * GB * eff).abs() < 1.0);
    // tp 8 fills the node: one member per node, one card, as the plain link.
    assert!((ring_bw(8, 2) - 50.0 * GB * eff).abs() < 1.0);
    let l = Layout {
        tp: 8,
        dp: 2,
        ..Layout::default()
    };
    assert_eq!(
        c.ring_link(&replica_group(&l, 8)),
        c.link(&replica_group(&l, 8))
    );
    // Inside one node the ring is NVLink's, whatever the cards.
    assert!((ring_bw(1, 8) - 450.0 * GB * eff).abs() < 1.0);
    // Many cards never beat NVLink: 16 members per node of 16 on 100 GB/s cards.
    let mut wide = Cluster::of(gpu("h100").unwrap(), 16).unwrap();
    wide.network.bw = 100.0 * GB;
    let l = Layout {
        dp: 32,
        ..Layout::default()
    };
    let bw = wide.ring_link(&replica_group(&l, 16)).bw;
    assert!((bw - 450.0 * GB * eff).abs() < 1.0, "{bw}");
}
