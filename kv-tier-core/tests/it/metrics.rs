//! The manager's metrics as a Prometheus scrape shows them (published by kv-tier-core's `metrics`,
//! rendered and served by the facade's `prometheus`): valid text, escaped tier names, counters that
//! never decrease and are the scraped manager's, the endpoint. The recorder is the process's: these
//! tests take turns on it.

use std::time::Duration;

use kv_tier::{KvTierConfig, Locality, RequestContext};
use kv_tier_testkit::test_key;

use crate::support::*;

/// Promise (kv-tier/src/prometheus.rs `render`): "the manager's statistics published now,
/// then every metric of the recorder in the Prometheus text format"; kv-tier-core/src/metrics.rs:
/// "all named `kv_tier_...` with the tier's name as the label `tier`", "Counters end in
/// `_total`". The text is valid exposition format (one HELP and TYPE per family, no duplicate
/// series, valid names) even with a tier name holding a quote, a backslash and a newline, and
/// that name comes back exactly from the label; or the name is refused naming the field.
#[test]
fn prometheus_text_is_valid_and_escapes_tier_names() {
    let _g = prom::RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    let weird = "we\"ird\\tier\nx";
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let json = format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [{{"type": "fs", "name": {}, "root_dir": {:?}, "enable_kv_events": true}},
                                {{"type": "fs", "name": "plain", "root_dir": {:?}}}]}}"#,
        32 * BS,
        LAYOUT,
        serde_json::to_string(weird).unwrap(),
        d1.path(),
        d2.path()
    );
    let m = match KvTierConfig::from_json_str(&json)
        .and_then(kv_tier::builder)
        .and_then(|b| b.build_blocking())
    {
        Ok(m) => m,
        Err(e) => {
            assert!(
                e.to_string().contains("name"),
                "refused without naming the field: {e}"
            );
            return;
        }
    };
    for i in 0..40 {
        store_evicting(&m, 1, &[test_key(i)]);
    }
    block_on_idle(&m);
    m.runtime().block_on(m.reset_cache());
    let req = RequestContext::new(5);
    for _ in 0..200 {
        let found = m.lookup_prefix(&[test_key(0), test_key(1)], &req);
        m.on_schedule_end();
        if found.hit == 2 {
            break;
        }
        block_on_idle(&m);
    }
    let (text, ex) = prom::scrape(&m);
    for (name, ty) in &ex.types {
        assert!(name.starts_with("kv_tier_"), "{name}");
        if ty == "counter" {
            assert!(
                name.ends_with("_total"),
                "counter not ending in _total: {name}"
            );
        }
    }
    let st = m.stats();
    let stored = prom::value(&ex, "kv_tier_blocks_stored_total", &[("tier", weird)]);
    assert_eq!(
        stored,
        Some(st.tiers[0].blocks_stored as f64),
        "the weird tier's series:\n{text}"
    );
    assert!(st.tiers[0].blocks_stored > 0);
    assert_eq!(
        prom::value(&ex, "kv_tier_blocks_stored_total", &[("tier", "plain")]),
        Some(st.tiers[1].blocks_stored as f64)
    );
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/metrics.rs): "Counters and gauges, published from the
/// statistics ... as they are now", "Counters end in `_total`"; Prometheus counters are
/// monotonic. Across scrapes with stores, evictions, lookups, promotions, reset_cache and
/// dropped events in between, no counter series goes down, and the DRAM figures equal the
/// stats at the scrape.
#[test]
fn prometheus_counters_never_decrease_and_match_stats() {
    let _g = prom::RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, "event_buffer_keys": 3, {},
            "secondary_tiers": [{{"type": "fs", "name": "mono", "root_dir": {:?},
              "enable_kv_events": true}}]}}"#,
        8 * BS,
        LAYOUT,
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    let mut prev: Option<prom::Exposition> = None;
    for round in 0..6u64 {
        for i in 0..12 {
            store_evicting(&m, round, &[test_key(round * 100 + i)]);
        }
        block_on_idle(&m);
        let req = RequestContext::new(round + 1000);
        let keys: Vec<_> = (0..4).map(|i| test_key(round * 100 + i)).collect();
        for _ in 0..50 {
            let f = m.lookup_prefix(&keys, &req);
            m.on_schedule_end();
            if f.hit == keys.len() {
                break;
            }
            block_on_idle(&m);
        }
        m.on_request_finished(req.id);
        if round % 2 == 1 {
            m.runtime().block_on(m.reset_cache());
        }
        let (_, ex) = prom::scrape(&m);
        let st = m.stats();
        // the tier-labelled series are this manager's alone (other tests' managers publish
        // the unlabelled DRAM ones too)
        let t = &st.tiers[0];
        assert_eq!(
            prom::value(&ex, "kv_tier_blocks_stored_total", &[("tier", "mono")]),
            Some(t.blocks_stored as f64)
        );
        assert_eq!(
            prom::value(&ex, "kv_tier_events_dropped_total", &[("tier", "mono")]),
            Some(t.events_dropped as f64)
        );
        assert_eq!(
            prom::value(&ex, "kv_tier_blocks_loaded_total", &[("tier", "mono")]),
            Some(t.blocks_loaded as f64)
        );
        if let Some(p) = &prev {
            for ((name, labels), v) in &p.series {
                let fam = name.strip_suffix("_bucket").unwrap_or(name);
                let fam = fam.strip_suffix("_count").unwrap_or(fam);
                let is_counter = p.types.get(name).map(|t| t == "counter").unwrap_or(false)
                    || p.types.get(fam).map(|t| t == "histogram").unwrap_or(false)
                        && !name.ends_with("_sum");
                if !is_counter {
                    continue;
                }
                let now = ex.series.get(&(name.clone(), labels.clone()));
                assert!(
                    now.is_some_and(|n| n >= v),
                    "round {round}: {name}{labels:?} went from {v} to {now:?}"
                );
            }
        }
        prev = Some(ex);
    }
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier/src/prometheus.rs `serve`): "each scrape publishes `manager`'s
/// statistics first, so every value is as of the scrape"; kv-tier-core/src/metrics.rs: "each
/// manager adds what it counted since it last published, so a counter is the sum over every
/// manager the process had, and never goes back (a manager replaced by a new one ... do not
/// hide each other's counts). Gauges are levels". An engine that replaces its manager (a
/// restart of the cache in the same process) and scrapes the new one sees the new manager's
/// counts added at once and its gauges. (Found: counters were published as absolute values,
/// kept as the larger of old and new: the new manager's 1 miss rendered as the old one's 500.)
#[test]
fn prometheus_figures_are_the_scraped_managers_after_a_replacement() {
    let _g = prom::RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    let misses =
        |ex: &prom::Exposition| prom::value(ex, "kv_tier_lookups_total", &[("verdict", "miss")]);
    let old = build(dram_cfg(64, BS, ""));
    // other tests of this process published before: counts are compared as increments
    let not_found = |ex: &prom::Exposition| {
        prom::value(ex, "kv_tier_misses_total", &[("cause", "not_found")]).unwrap_or(0.0)
    };
    let (_, ex) = prom::scrape(&old);
    let m0 = misses(&ex).unwrap_or(0.0);
    let n0 = not_found(&ex);
    for i in 0..64 {
        store_evicting(&old, 1, &[test_key(i)]);
    }
    for i in 0..500 {
        old.lookup(&test_key(10_000 + i), &RequestContext::new(1));
    }
    let (_, ex) = prom::scrape(&old);
    let m1 = misses(&ex).unwrap();
    assert_eq!(m1 - m0, old.stats().misses as f64);
    // every one of them a block no tier has: the misses by cause say so
    assert_eq!(not_found(&ex) - n0, old.stats().misses as f64);
    drop(old);
    let new = build(dram_cfg(8, BS, ""));
    store_evicting(&new, 1, &[test_key(1)]);
    new.lookup(&test_key(99_999), &RequestContext::new(1));
    let (text, ex) = prom::scrape(&new);
    let st = new.stats();
    assert_eq!(st.misses, 1);
    let got = |n: &str, l: &[(&str, &str)]| prom::value(&ex, n, l);
    let mut wrong = Vec::new();
    for (name, labels, want) in [
        (
            "kv_tier_lookups_total",
            vec![("verdict", "miss")],
            m1 + st.misses as f64,
        ),
        (
            "kv_tier_dram_capacity_bytes",
            vec![],
            (st.primary.capacity_blocks * BS) as f64,
        ),
        (
            "kv_tier_dram_used_bytes",
            vec![],
            ((st.primary.ready_blocks + st.primary.writing_blocks) * BS) as f64,
        ),
    ] {
        let v = got(name, &labels);
        if v != Some(want) {
            wrong.push(format!("{name}{labels:?}: rendered {v:?}, want {want}"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}\n{text}");
    // a second scrape of the new manager with nothing new counted adds nothing
    let (_, ex) = prom::scrape(&new);
    assert_eq!(misses(&ex), Some(m1 + 1.0));
}

/// Promise (kv-tier/src/prometheus.rs `serve`): "serves `GET /metrics` ... Other paths answer
/// 404. The endpoint does not keep the manager alive: once it is dropped, scrapes render what
/// was recorded last."
#[test]
fn prometheus_endpoint_serves_metrics_404s_the_rest_and_outlives_the_manager() {
    use std::io::{Read, Write};
    let _g = prom::RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let get = |addr: std::net::SocketAddr, path: &str| -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    rt.block_on(async {
        let m = std::sync::Arc::new(
            kv_tier::builder(dram_cfg(8, BS, ""))
                .unwrap()
                .build()
                .await
                .unwrap(),
        );
        store_evicting(&m, 1, &[test_key(1)]);
        let ep = kv_tier::prometheus::serve("127.0.0.1:0".parse().unwrap(), &m)
            .await
            .unwrap();
        let addr = ep.addr();
        let r = tokio::task::spawn_blocking(move || get(addr, "/metrics"))
            .await
            .unwrap();
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        let body = r.split("\r\n\r\n").nth(1).unwrap();
        prom::parse(body);
        assert!(body.contains("kv_tier_dram_capacity_bytes"), "{body}");
        let r = tokio::task::spawn_blocking(move || get(addr, "/other"))
            .await
            .unwrap();
        assert!(r.starts_with("HTTP/1.1 404"), "{r}");
        m.shutdown().await.unwrap();
        drop(m);
        let r = tokio::task::spawn_blocking(move || get(addr, "/metrics"))
            .await
            .unwrap();
        assert!(
            r.starts_with("HTTP/1.1 200"),
            "after the manager is gone: {r}"
        );
        drop(ep);
    });
}

/// Promise (kv-tier/src/prometheus.rs `render` and kv-tier-core/src/metrics.rs): every tier's
/// own figures are published as `kv_tier_<type>_<figure>` "with the tier's name as the label
/// `tier`", in the Prometheus text format. With an fs tier and an obj tier (a real S3 server)
/// that have stored and served blocks, the text is valid exposition format and each tier's
/// own families carry its label.
#[test]
fn prometheus_text_with_fs_and_obj_tiers_is_valid() {
    let _g = prom::RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let s3 = rt.block_on(kv_tier_testkit::s3::S3Server::start());
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [
              {{"type": "fs", "name": "fsx", "root_dir": {:?}, "gc_max_size_gb": 1}},
              {{"type": "obj", "name": "objx", "bucket": "{}", "endpoint_override": "{}",
                "scheme": "http", "access_key": "{}", "secret_key": "{}", "probe_budget_s": 1,
                "checksum": "crc32c", "enable_kv_events": true}}]}}"#,
        16 * BS,
        LAYOUT,
        dir.path(),
        kv_tier_testkit::s3::BUCKET,
        s3.endpoint,
        kv_tier_testkit::s3::AK,
        kv_tier_testkit::s3::SK
    ))
    .unwrap();
    let m = build(c);
    let keys: Vec<_> = (0..6).map(test_key).collect();
    store_evicting(&m, 1, &keys);
    block_on_idle(&m);
    m.runtime().block_on(m.reset_cache());
    // promote from obj only
    let req = RequestContext::new(3).only_tiers(["objx"]);
    for _ in 0..200 {
        let f = m.lookup_prefix(&keys[..2], &req);
        m.on_schedule_end();
        if f.hit == 2 {
            break;
        }
        block_on_idle(&m);
    }
    m.on_request_finished(req.id);
    let (text, ex) = prom::scrape(&m);
    let st = m.stats();
    assert_eq!(st.tiers[1].blocks_loaded, 2, "{:?}", st.tiers[1]);
    for (tier, ty) in [("fsx", "fs"), ("objx", "obj")] {
        let own: Vec<_> = ex
            .series
            .keys()
            .filter(|(n, l)| {
                n.starts_with(&format!("kv_tier_{ty}_"))
                    && l.iter().any(|(a, b)| a == "tier" && b == tier)
            })
            .collect();
        assert!(
            !own.is_empty(),
            "no kv_tier_{ty}_* series for {tier}:\n{text}"
        );
    }
    assert_eq!(
        prom::value(&ex, "kv_tier_blocks_loaded_total", &[("tier", "objx")]),
        Some(2.0)
    );
    let obj_events = by_tier(&m.take_events()).remove("objx").unwrap_or_default();
    assert!(
        obj_events.iter().all(|e| e.locality == Locality::Remote),
        "{obj_events:?}"
    );
    m.shutdown_blocking().unwrap();
    drop(s3);
    drop(rt);
}
