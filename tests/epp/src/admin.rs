//! Glue: the admin HTTP page. `GET /stats` is the pool's snapshot as JSON (per pod: metrics,
//! scrape record, picks, prefix index size; totals: every counter); `GET /healthz` is `ok`.

use std::sync::Arc;

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use rand::Rng;
use serde_json::Value;

use crate::pool::Pool;
use crate::scrape::Clock;

struct Shared<R> {
    pool: Arc<Pool<R>>,
    clock: Arc<dyn Clock>,
}

async fn stats<R: Rng + Send + 'static>(State(s): State<Arc<Shared<R>>>) -> Json<Value> {
    Json(s.pool.snapshot(s.clock.now_ms()))
}

/// The admin routes over a pool.
pub fn router<R: Rng + Send + 'static>(pool: Arc<Pool<R>>, clock: Arc<dyn Clock>) -> Router {
    Router::new()
        .route("/stats", get(stats::<R>))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(Arc::new(Shared { pool, clock }))
}
