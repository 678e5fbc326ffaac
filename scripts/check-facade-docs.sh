#!/usr/bin/env bash
# The API docs a user of the `verbio` crate reads are whole: documented
# alone (`cargo doc --no-deps -p verbio`, as docs.rs builds the facade),
# every link leads to a generated page, and the pages of each layer's
# main items are there (reachable from the facade, not only in
# verbio-runtime's or verbio-ops' own docs). Run by .ci/run.
#
# Deletes the target directory's doc/ first: pages of the other crates left
# there by an earlier `cargo doc --workspace` would hide a dead link.
set -euo pipefail
cd "$(dirname "$0")/.."
doc="${CARGO_TARGET_DIR:-target}/doc"
rm -rf "$doc"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps -q -p verbio --features tokio,async-io
python3 scripts/check-doc-links.py "$doc" verbio
missing=0
for page in \
    verbio/index.html \
    verbio/runtime/index.html \
    verbio/runtime/struct.Runtime.html \
    verbio/runtime/fn.spawn.html \
    verbio/runtime/struct.Device.html \
    verbio/runtime/struct.QueuePair.html \
    verbio/runtime/struct.RecvRing.html \
    verbio/runtime/buf/struct.MrPool.html \
    verbio/runtime/compat/tokio/index.html \
    verbio/runtime/compat/async_io/index.html \
    verbio/runtime/cm/index.html \
    verbio/runtime/struct.Pool.html \
    verbio/struct.RdmaHandle.html \
    verbio/ops/index.html \
    verbio/ops/verbs/trait.Verbs.html \
    verbio/ops/connect/index.html \
    verbio/struct.Rdma.html \
    verbio/struct.RdmaBuilder.html \
    verbio/struct.ErrorChain.html \
    verbio/rpc/struct.Rpc.html \
    verbio/rpc/struct.RpcAddr.html \
    verbio/provider/fn.open_device.html; do
    if [ ! -f "$doc/$page" ]; then
        echo "missing page: $page (not reachable from the verbio facade)"
        missing=1
    fi
done
# The crate root's links into the layers are links, not plain text.
for link in 'href="runtime/index.html"' 'href="ops/index.html"' 'href="struct.Rdma.html"' 'href="rpc/struct.Rpc.html"'; do
    grep -q "$link" "$doc/verbio/index.html" || { echo "the crate root has no $link"; missing=1; }
done
exit $missing
