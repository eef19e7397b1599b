#!/usr/bin/env bash
# Debian packages the tests need beyond PyPI: the shared libraries Mooncake's wheel links
# against (RDMA verbs, NUMA, io_uring, curl), and redis-server plus openssl for the Redis TLS
# test (the valkey-server from PyPI is built without TLS). Installs what is missing with
# apt-get when possible; otherwise says what to run.
set -euo pipefail
missing=()
libs=$(ldconfig -p)
for pair in libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1 \
            liburing.so.2:liburing2 libcurl.so.4:libcurl4; do
  [[ $libs == *"${pair%%:*} "* ]] || missing+=("${pair##*:}")
done
for pair in redis-server:redis-server openssl:openssl; do
  command -v "${pair%%:*}" >/dev/null || missing+=("${pair##*:}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
cmd=(apt-get install -y -q --no-install-recommends "${missing[@]}")
if ! command -v apt-get >/dev/null; then
  echo "the tests need these (Debian names): ${missing[*]}; install them and rerun." >&2
  exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then cmd=(sudo "${cmd[@]}"); else
    echo "the tests need: ${cmd[*]} (run it as root, then rerun)" >&2; exit 1; fi
fi
echo "installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${cmd[@]}" >/dev/null || { "${cmd[0]}" update -q >/dev/null 2>&1 || true; "${cmd[@]}" >/dev/null; }
