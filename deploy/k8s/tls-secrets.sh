#!/usr/bin/env bash
# Creates (or updates) the two kubernetes.io/tls Secrets of the decode-to-prefill mutual TLS,
# for clusters without cert-manager (with it, use ../components/cert-manager instead):
#
#   kvwire-prefill-tls   tls.crt tls.key ca.crt   the prefill pods' server certificate
#   kvwire-decode-tls    tls.crt tls.key ca.crt   the decode pods' client certificate
#
# The certificates come from scripts/make_certs.sh (ECDSA P-256, the prefill certificate naming
# kvwire-prefill, the name the decode pods check), made in --certs DIR and kept there: the CA's
# key stays on this machine, and a rerun reuses what is there.
#
#   deploy/k8s/tls-secrets.sh [-n NAMESPACE] [--certs DIR] [--days N] [--force|--new-ca] [--print]
#
# After --force (new node certificates, same CA: old and new pods still trust each other),
# restart the pods, which read their certificates only when they start:
#   kubectl -n NAMESPACE rollout restart deployment/kvwire-prefill deployment/kvwire-decode
# After --new-ca, pods holding the old files and pods holding the new ones refuse each other:
# restart them all at once (see deploy/k8s/README.md).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# The name the decode pods check in the prefill certificate (base/decode.yaml's
# --prefill-tls-server-name; tests/deploy/k8s_render_test.py keeps the two equal).
PREFILL_NAME=kvwire-prefill

usage() {
  cat <<'EOF'
usage: deploy/k8s/tls-secrets.sh [-n NAMESPACE] [--certs DIR] [--days N] [--force|--new-ca]
                                 [--print]

Makes the CA and node certificates with scripts/make_certs.sh (kept in --certs DIR) and applies
the Secrets kvwire-prefill-tls and kvwire-decode-tls (type kubernetes.io/tls: tls.crt, tls.key,
ca.crt) with kubectl.

options:
  -n, --namespace NS  namespace of the Secrets (default: kubectl's current one)
  --certs DIR         where the certificates and the CA's key are kept
                      (default build/k8s-tls; keep it private, and keep it: the CA's key signs
                      every later rotation)
  --days N            validity of new node certificates in days (default 365)
  --force             new node certificates from the same CA (rotation); restart the pods after
  --new-ca            a new CA and new node certificates; restart all decode and prefill pods
                      together after
  --print             print the Secrets' YAML instead of applying it (it holds private keys)

environment: KVWIRE_KUBECTL [kubectl]
EOF
}

die() {
  echo "tls-secrets.sh: error: $*" >&2
  exit 1
}
say() { echo "tls-secrets.sh: $*" >&2; }

NAMESPACE=""
CERTS="$REPO/build/k8s-tls"
DAYS=365
FORCE=()
PRINT=0
while [[ $# -gt 0 ]]; do
  case $1 in
    -n | --namespace) NAMESPACE=${2:?$1 needs a value}; shift 2 ;;
    --certs) CERTS=${2:?--certs needs a value}; shift 2 ;;
    --days) DAYS=${2:?--days needs a value}; shift 2 ;;
    --force) FORCE=(--force); shift ;;
    --new-ca) FORCE=(--new-ca); shift ;;
    --print) PRINT=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown option '$1'" ;;
  esac
done
KUBECTL=${KVWIRE_KUBECTL:-kubectl}
command -v "$KUBECTL" >/dev/null || die "kubectl not found (looked for '$KUBECTL')"

# make_certs.sh's messages go to stderr: with --print, stdout is the YAML only.
"$REPO/scripts/make_certs.sh" "$CERTS" --prefill-names "$PREFILL_NAME" --days "$DAYS" \
  "${FORCE[@]+"${FORCE[@]}"}" >&2 ||
  die "no usable certificates in $CERTS (above)"

ns_args=()
[[ -n $NAMESPACE ]] && ns_args=(--namespace "$NAMESPACE")
manifests() {
  local id
  for id in prefill decode; do
    echo "---"
    "$KUBECTL" create secret generic "kvwire-$id-tls" --type=kubernetes.io/tls \
      "${ns_args[@]+"${ns_args[@]}"}" \
      --from-file=tls.crt="$CERTS/$id/tls.crt" --from-file=tls.key="$CERTS/$id/tls.key" \
      --from-file=ca.crt="$CERTS/$id/ca.crt" --dry-run=client -o yaml
  done
}

if ((PRINT)); then
  manifests
  exit 0
fi
manifests | "$KUBECTL" apply "${ns_args[@]+"${ns_args[@]}"}" -f - >&2
say "applied the Secrets kvwire-prefill-tls and kvwire-decode-tls${NAMESPACE:+ in $NAMESPACE}" \
  "(certificates in $CERTS)"
say "pods read them when they start; after a change: kubectl${NAMESPACE:+ -n $NAMESPACE}" \
  "rollout restart deployment/kvwire-prefill deployment/kvwire-decode"
