//! The cost model's unit tests.

use super::*;

#[test]
fn fit_recovers_exact_line() {
    let truth = LinkModel {
        latency_us: 25.0,
        bus_gbps: 40.0,
    };
    let s: Vec<(u64, f64)> = [1u64 << 16, 1 << 20, 1 << 24, 1 << 28]
        .iter()
        .map(|&b| (b, truth.time_us(b, 4)))
        .collect();
    let m = LinkModel::fit(&s, 4).unwrap();
    assert!((m.latency_us - 25.0).abs() < 1e-6, "{m:?}");
    assert!((m.bus_gbps - 40.0).abs() < 1e-6, "{m:?}");
}

#[test]
fn a_copy_fit_counts_every_byte() {
    let truth = LinkModel {
        latency_us: 8.0,
        bus_gbps: 25.0,
    };
    let s: Vec<(u64, f64)> = [1u64 << 20, 1 << 24, 1 << 26]
        .iter()
        .map(|&b| (b, truth.copy_us(b)))
        .collect();
    let m = LinkModel::fit_copy(&s).unwrap();
    assert!((m.latency_us - 8.0).abs() < 1e-6, "{m:?}");
    assert!((m.bus_gbps - 25.0).abs() < 1e-6, "{m:?}");
    assert_eq!(m.copy_us(0), 0.0);
    // 64 MiB at 25 GB/s: 2.68 ms, whatever the world size
    assert!((m.copy_us(1 << 26) - (8.0 + 67_108_864.0 / 25e3)).abs() < 1e-9);
}

#[test]
fn an_all_reduce_fit_recovers_the_link_the_planner_times() {
    let truth = LinkModel {
        latency_us: 40.0,
        bus_gbps: 12.5,
    };
    let s: Vec<(u64, f64)> = [1u64 << 16, 1 << 20, 1 << 24]
        .iter()
        .map(|&b| (b, truth.all_reduce_us(b, 4)))
        .collect();
    let m = LinkModel::fit_all_reduce(&s, 4).unwrap();
    assert!((m.latency_us - 40.0).abs() < 1e-6, "{m:?}");
    assert!((m.bus_gbps - 12.5).abs() < 1e-6, "{m:?}");
    let hybrid = CostModel {
        replicas: 4,
        inter: Some(m),
        ..CostModel::nvlink(8)
    };
    // 16 MiB across 4: 3/4 of it twice at 12.5 GB/s
    let want = 40.0 + 2.0 * 16_777_216.0 * 0.75 / 12.5e3;
    assert!((hybrid.all_reduce_us(1 << 24) - want).abs() < 1e-6);
    assert!(LinkModel::fit_all_reduce(&s, 1).is_err());
}

#[test]
fn fit_rejects_degenerate_sweeps() {
    assert!(LinkModel::fit(&[(1024, 10.0)], 2).is_err());
    assert!(LinkModel::fit(&[(1024, 10.0), (2048, 9.0), (4096, 8.0)], 2).is_err());
    assert!(LinkModel::fit(&[(1024, 10.0), (2048, 20.0)], 1).is_err());
}

#[test]
fn presets_match_measurements() {
    let nop2p = CostModel::nop2p(2);
    // Within 25% of every measured point (latency floor included).
    for &(b, us) in NOP2P_2XH200_ALLGATHER.iter() {
        let p = nop2p.allgather_us(b);
        assert!((p - us).abs() / us < 0.25, "{b}: {p} vs {us}");
    }
    assert!(
        (40.0..60.0).contains(&nop2p.allgather.alg_gbps(2)),
        "{:?}",
        nop2p.allgather
    );
    let nvl = CostModel::nvlink(2);
    assert!(nvl.allgather.alg_gbps(2) > 300.0, "{:?}", nvl.allgather);
    for &(b, us) in NVLINK_2XH200_ALLGATHER.iter().skip(3) {
        let p = nvl.allgather_us(b);
        assert!((p - us).abs() / us < 0.25, "{b}: {p} vs {us}");
    }
}

#[test]
fn ring_scaling() {
    let m = CostModel::nop2p(2);
    let m8 = m.with_world(8);
    let big = 1u64 << 30;
    let t2 = m.allgather_us(big) - m.allgather.latency_us;
    let t8 = m8.allgather_us(big) - m8.allgather.latency_us;
    assert!((t8 / t2 - (7.0 / 8.0) / 0.5).abs() < 1e-9);
    assert_eq!(m.with_world(1).allgather_us(big), 0.0);
}

#[test]
fn json_round_trip_and_validation() {
    let m = CostModel::nop2p(2);
    assert_eq!(CostModel::from_json(&m.to_json()).unwrap(), m);
    let bad = r#"{"world":2,"allgather":{"latency_us":1,"bus_gbps":0},"reduce_scatter":{"latency_us":1,"bus_gbps":1}}"#;
    assert!(CostModel::from_json(bad).is_err());
    // The host link: optional, kept through JSON, validated like the others.
    assert!(!m.to_json().contains("host"), "no host link: not written");
    let with_host = CostModel {
        host: Some(LinkModel {
            latency_us: 10.0,
            bus_gbps: 20.0,
        }),
        ..m.clone()
    };
    assert_eq!(
        CostModel::from_json(&with_host.to_json()).unwrap(),
        with_host
    );
    assert_eq!(m.host_copy_us(1 << 20), 0.0);
    assert!(with_host.host_copy_us(1 << 20) > 10.0);
    let bad_host = r#"{"world":2,"allgather":{"latency_us":1,"bus_gbps":1},"reduce_scatter":{"latency_us":1,"bus_gbps":1},"host":{"latency_us":-1,"bus_gbps":1}}"#;
    assert!(CostModel::from_json(bad_host).is_err());
}
