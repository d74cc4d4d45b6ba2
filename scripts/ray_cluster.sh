#!/usr/bin/env bash
# One Ray cluster over several GPU nodes, for train.py --ray-address auto. Run it inside the
# project's image on every node, the head first:
#
#   head:    bash scripts/ray_cluster.sh head
#   worker:  bash scripts/ray_cluster.sh worker HEAD_IP
#   status:  bash scripts/ray_cluster.sh status
#   stop:    bash scripts/ray_cluster.sh stop          (on each node)
#
# Every node, and the shell that runs train.py, must see the same RAY_AUTH_MODE and token: Ray
# authenticates cluster traffic with a shared token (RAY_AUTH_MODE=token, the default here). The
# head creates ~/.ray/auth_token when none is given; copy that file to every worker's
# ~/.ray/auth_token, or export RAY_AUTH_TOKEN with its content everywhere. RAY_AUTH_MODE=disabled
# turns authentication off (trusted, isolated networks only).
#
# Environment: RAY_PORT (6379), NODE_IP (first address of `hostname -I`), NUM_GPUS (nvidia-smi -L).
set -euo pipefail

ROLE="${1:-}"
RAY_PORT="${RAY_PORT:-6379}"
NODE_IP="${NODE_IP:-$(hostname -I | awk '{print $1}')}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

num_gpus() {
   if [[ -n "${NUM_GPUS:-}" ]]; then
      echo "${NUM_GPUS}"
   else
      nvidia-smi -L | grep -c '^GPU '
   fi
}

case "${ROLE}" in
   head)
      if [[ "${RAY_AUTH_MODE}" == token && -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
         ray get-auth-token --generate > /dev/null
         echo "token in ~/.ray/auth_token: copy it to every worker and to the shell that runs train.py"
      fi
      ray start --head --node-ip-address "${NODE_IP}" --port "${RAY_PORT}" \
         --num-gpus "$(num_gpus)" --disable-usage-stats
      echo "workers: bash scripts/ray_cluster.sh worker ${NODE_IP}"
      echo "then, on this node: bash scripts/run-qwen3-4B.sh --ray-address auto ..."
      ;;
   worker)
      HEAD_IP="${2:?usage: $0 worker HEAD_IP}"
      ray start --address "${HEAD_IP}:${RAY_PORT}" --node-ip-address "${NODE_IP}" \
         --num-gpus "$(num_gpus)" --disable-usage-stats
      ;;
   status)
      ray status
      ;;
   stop)
      ray stop
      ;;
   *)
      echo "usage: $0 head | worker HEAD_IP | status | stop" >&2
      exit 2
      ;;
esac
