#!/usr/bin/env python3
"""The Kubernetes manifests and images of deploy/ against the real binaries and tools.

`kubectl kustomize` renders deploy/k8s/base and both overlays (cpu-demo, gpu); then, for every
rendering:

  * every kvwire container's command and args, with $(VAR) expanded as the kubelet does (from
    its env, envFrom ConfigMaps, the downward API), are accepted by the real binary with
    --dry-run, and carry every flag of deploy/local/node-flags.env for their role, as
    deploy/local/cluster.sh passes them;
  * the ports the binary listens on (--listen, --metrics-listen, or their defaults) are the
    containerPorts, the gRPC probes' ports, the Services' targetPorts and the scrape
    annotation's port;
  * the decode nodes' --prefill names the headless prefill Service and its port, and the
    router's nginx.conf (which the real nginx accepts) names the decode ClusterIP Service;
  * decode and prefill pods talk in mutual TLS: every prefill container serves with a server
    certificate and a client CA, every decode container has a client certificate and the CA,
    all files from read-only kubernetes.io/tls Secret mounts, nothing passes --insecure, and the
    probes of a TLS port are TCP (the kubelet's gRPC probes speak only plaintext);
  * a NetworkPolicy lets only decode pods reach the prefill pods' gRPC port and keeps their
    /metrics reachable;
  * the Secrets match what mounts them: those the cert-manager component issues (rendered with
    the cpu-demo overlay as "cert-manager") and those deploy/k8s/tls-secrets.sh makes, the
    prefill certificate carrying the name the decode nodes check;
  * resources, non-root read-only containers, drain timing (terminationGracePeriodSeconds >
    preStop + --grace-ms), the model volume, and what each overlay is for (gpu: nvidia.com/gpu
    and the CPU backend; cpu-demo: the stories model and one thread);
  * the copies in deploy/k8s/base are current (deploy/k8s/sync.sh --check);
  * Prometheus's relabeling (the real promtool) turns the rendered pods into exactly one scrape
    target per prefill and decode pod, from deploy/k8s/prometheus/prometheus.yml;
  * the Dockerfiles install a package for every shared library the built binaries need, build
    with portable flags and without tests, and put the binaries where the manifests run them.

Needs kubectl and python3-yaml; prints "SKIP: ..." and exits 0 without them.

usage: k8s_render_test.py --repo-root DIR --build-dir DIR [unittest options]
"""
import argparse
import base64
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

try:
  import yaml
except ImportError:  # main() skips
  yaml = None

REPO = ""
BUILD = ""

RENDERINGS = {
    "base": "deploy/k8s/base",
    "cpu-demo": "deploy/k8s/overlays/cpu-demo",
    "gpu": "deploy/k8s/overlays/gpu",
    # Not a folder of the repository: cpu-demo with components/cert-manager, written into a
    # copy of deploy/k8s (kustomize takes no absolute paths), as the README tells users to.
    "cert-manager": "overlays/cpu-demo-cert-manager",
}
CERT_MANAGER_OVERLAY = """apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [../cpu-demo]
components: [../../components/cert-manager]
"""
# The files of a kubernetes.io/tls Secret (as cert-manager writes it).
TLS_KEYS = {"tls.crt", "tls.key", "ca.crt"}
# Command basename -> (role, path of the binary in the build tree).
BINARIES = {
    "kvwire-prefill": ("prefill", "prefill_service/kvwire-prefill"),
    "kvwire-decode": ("decode", "decode_service/kvwire-decode"),
}
MODEL_CLAIM = "kvwire-model"
# Libraries every Debian/Ubuntu base image has.
BASE_IMAGE_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6"}


# ---- helpers ------------------------------------------------------------------------------------

def find_kubectl():
  return shutil.which(os.environ.get("KVWIRE_KUBECTL", "kubectl"))


def expand(text, env):
  """Kubernetes' $(VAR) expansion of command, args and env values: $(NAME) becomes NAME's
  value when NAME is defined and stays as written otherwise; $$ is a literal $."""
  out, i = [], 0
  while i < len(text):
    if text.startswith("$$", i):
      out.append("$")
      i += 2
    elif text.startswith("$(", i) and ")" in text[i:]:
      end = text.index(")", i)
      name = text[i + 2:end]
      out.append(env[name] if name in env else text[i:end + 1])
      i = end + 1
    else:
      out.append(text[i])
      i += 1
  return "".join(out)


def cpu_quantity(q):
  q = str(q)
  return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


_BIN = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DEC = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def memory_quantity(q):
  m = re.match(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$", str(q))
  if not m:
    raise AssertionError("cannot read the memory quantity %r" % q)
  unit = m.group(2) or ""
  return float(m.group(1)) * (_BIN.get(unit) or _DEC.get(unit) or 1)


def kvwire_bytes(text):
  """kvwire's byte sizes (ParseBytes): 256MiB, 64KiB, 1GiB, plain bytes."""
  m = re.match(r"^(\d+)(B|KiB|MiB|GiB|TiB)?$", text)
  if not m:
    raise AssertionError("cannot read the kvwire byte size %r" % text)
  return int(m.group(1)) * {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30,
                            "TiB": 2**40}[m.group(2) or ""]


def flag_map(argv):
  """--name=value and --name value flags (the last one wins, as kvwire's parser)."""
  flags, i = {}, 0
  while i < len(argv):
    arg = argv[i]
    if arg.startswith("--") and "=" in arg:
      name, value = arg[2:].split("=", 1)
      flags[name] = value
    elif arg.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
      flags[arg[2:]] = argv[i + 1]
      i += 1
    elif arg.startswith("--"):
      flags[arg[2:]] = "true"
    i += 1
  return flags


_HELP = {}


def flag_defaults(binary):
  """{flag: default} from `binary --help` ("  --listen VALUE  ... (default 0.0.0.0:50051)")."""
  if binary not in _HELP:
    text = subprocess.run([binary, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=30).stdout
    _HELP[binary] = {m.group(1): m.group(2) for m in
                     re.finditer(r"^\s+--([a-z0-9-]+) VALUE.*\(default (.*)\)$", text, re.M)}
  return _HELP[binary]


def port_of(address, what):
  m = re.match(r"^(?:\[[0-9a-fA-F:]*\]|[^:]*):(\d+)$", address)
  if not m:
    raise AssertionError("%s: %r is not HOST:PORT" % (what, address))
  return int(m.group(1))


def node_flags(role):
  """The flags deploy/local/cluster.sh derives from node-flags.env for a role."""
  flags = {}
  with open(os.path.join(REPO, "deploy", "local", "node-flags.env")) as f:
    for line in f:
      m = re.match(r"^%s_([A-Z0-9_]+)=(\S*)$" % role.upper(), line.strip())
      if m:
        flags[m.group(1).lower().replace("_", "-")] = m.group(2)
  return flags


def selects(selector, labels):
  return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def label_selector_matches(selector, labels):
  """A metav1.LabelSelector (matchLabels, matchExpressions) against labels; {} selects all."""
  if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
    return False
  for e in selector.get("matchExpressions", []):
    key, op, values = e["key"], e["operator"], e.get("values", [])
    if not {"In": lambda: labels.get(key) in values,
            "NotIn": lambda: labels.get(key) not in values,
            "Exists": lambda: key in labels,
            "DoesNotExist": lambda: key not in labels}[op]():
      return False
  return True


def dockerfile_stages(path):
  """[(base image, stage name, [instructions])] of a Dockerfile; an instruction is (KEYWORD,
  text) with continuation lines joined and comments dropped. ARGs before the first FROM are
  substituted into FROM lines."""
  with open(path) as f:
    lines = [l for l in f.read().split("\n") if not l.lstrip().startswith("#")]
  text = re.sub(r"\\\n", " ", "\n".join(lines))
  args, stages = {}, []
  for line in text.split("\n"):
    line = line.strip()
    if not line:
      continue
    keyword, _, rest = line.partition(" ")
    keyword = keyword.upper()
    if keyword == "ARG" and not stages:
      name, _, default = rest.strip().partition("=")
      args[name] = default
    elif keyword == "FROM":
      image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), rest.split()[0])
      name = rest.split()[2] if len(rest.split()) == 3 and rest.split()[1].upper() == "AS" else ""
      stages.append((image, name, []))
    elif stages:
      stages[-1][2].append((keyword, " ".join(rest.split())))
  return stages


def apt_packages(instructions):
  """Packages named by `apt-get install` in a stage's RUN instructions."""
  pkgs = []
  for keyword, text in instructions:
    if keyword != "RUN":
      continue
    for m in re.finditer(r"apt-get install ((?:[^&;|]|&(?!&))*)", text):
      pkgs += [w for w in m.group(1).split() if not w.startswith("-")]
  return pkgs


def install_deps_packages():
  with open(os.path.join(REPO, "scripts", "install_deps.sh")) as f:
    m = re.search(r"^PACKAGES=\((.*?)^\)", f.read(), re.S | re.M)
  if not m:
    raise AssertionError("scripts/install_deps.sh: no PACKAGES=( ... ) list")
  return set(m.group(1).split())


def packages_of(paths):
  """{path: the Debian package that installed the file, or None (e.g. the CUDA toolkit's)}.
  dpkg knows a file by the path its package ships, so the symlink, its target, and both sides
  of the /lib -> /usr/lib merge are asked (in one dpkg call: each takes a while)."""
  candidates = {}
  for path in paths:
    real = os.path.realpath(path)
    names = [path, real]
    for p in (path, real):
      names.append(p[len("/usr"):] if p.startswith("/usr/lib/") else
                   "/usr" + p if p.startswith("/lib/") else p)
    candidates[path] = names
  every = sorted({n for names in candidates.values() for n in names})
  out = subprocess.run(["dpkg", "-S"] + every, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       text=True).stdout
  owner = {}
  for line in out.splitlines():
    pkg, _, file = line.partition(": ")
    owner[file.strip()] = pkg.split(":")[0].split(",")[0].strip()
  return {path: next((owner[n] for n in names if n in owner), None)
          for path, names in candidates.items()}


def debian_packages_missing(packages):
  """The names among `packages` that apt does not know (one apt-cache call: each takes a
  second), or None when apt's package lists are absent."""
  if subprocess.run(["apt-cache", "show", "--no-all-versions", "libc6"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
    return None
  out = subprocess.run(["apt-cache", "show", "--no-all-versions"] + sorted(packages),
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
  return set(packages) - set(re.findall(r"^Package: (\S+)$", out, re.M))


def needed_libraries(binary):
  """{soname: resolved path} of the libraries the binary links directly (NEEDED)."""
  dyn = subprocess.run(["readelf", "-d", binary], stdout=subprocess.PIPE, text=True, check=True)
  needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dyn.stdout)
  ldd = subprocess.run(["ldd", binary], stdout=subprocess.PIPE, text=True, check=True).stdout
  where = dict(re.findall(r"^\s*(\S+) => (\S+)", ldd, re.M))
  missing = [n for n in needed if n not in where or where[n] == "not"]
  if missing:
    raise AssertionError("%s: ldd cannot find %s" % (binary, missing))
  return {n: where[n] for n in needed}


# ---- one rendering --------------------------------------------------------------------------

class Container:
  """A container of a pod template, its env resolved and its command expanded."""

  def __init__(self, rendering, owner, pod, spec, init=False):
    self.rendering, self.owner, self.pod, self.spec, self.init = rendering, owner, pod, spec, init
    self.name = spec["name"]
    self.what = "%s: %s %s, container %s" % (rendering.name, owner["kind"],
                                             owner["metadata"]["name"], self.name)
    self.env, self.unresolved = self._env()
    self.argv = [expand(a, self.env) for a in spec.get("command", []) + spec.get("args", [])]
    base = os.path.basename(spec.get("command", [""])[0]) if spec.get("command") else ""
    self.binary_name = base if base in BINARIES else None
    self.role = BINARIES[base][0] if self.binary_name else None
    self.flags = flag_map(self.argv[1:])

  def _env(self):
    env, unresolved = {}, []
    for source in self.spec.get("envFrom", []):
      if "configMapRef" in source:
        cm = self.rendering.configmap(source["configMapRef"]["name"], self.what)
        env.update({source.get("prefix", "") + k: v for k, v in cm.get("data", {}).items()})
      else:
        unresolved.append("envFrom %s" % source)
    for var in self.spec.get("env", []):
      if "value" in var:
        env[var["name"]] = expand(str(var["value"]), env)
        continue
      ref = var.get("valueFrom", {})
      if "configMapKeyRef" in ref:
        cm = self.rendering.configmap(ref["configMapKeyRef"]["name"], self.what)
        env[var["name"]] = cm.get("data", {})[ref["configMapKeyRef"]["key"]]
      elif "fieldRef" in ref:
        field = ref["fieldRef"]["fieldPath"]
        env[var["name"]] = {"metadata.name": self.owner["metadata"]["name"] + "-0",
                            "metadata.namespace": "default",
                            "status.podIP": "10.0.0.1"}.get(field, "")
      elif "resourceFieldRef" in ref:
        env[var["name"]] = self._resource_field(ref["resourceFieldRef"])
      else:
        unresolved.append("env %s" % var["name"])
    return env, unresolved

  def _resource_field(self, ref):
    """The downward API's value of limits.cpu etc.: rounded up to whole divisors."""
    kind, resource = ref["resource"].split(".")
    name = ref.get("containerName", self.name)
    spec = next(c for c in self.pod["spec"]["containers"] if c["name"] == name)
    quantity = spec.get("resources", {}).get(kind, {}).get(resource)
    if quantity is None:
      raise AssertionError("%s: resourceFieldRef %s of container %s, which sets none"
                           % (self.what, ref["resource"], name))
    divisor = str(ref.get("divisor", "1"))
    if resource == "cpu":
      return str(math.ceil(cpu_quantity(quantity) / cpu_quantity(divisor) - 1e-9))
    return str(math.ceil(memory_quantity(quantity) / memory_quantity(divisor)))

  def binary(self):
    return os.path.join(BUILD, BINARIES[self.binary_name][1])

  def flag(self, name):
    """A flag's value as the binary will see it: from argv, else the binary's default."""
    if name in self.flags:
      return self.flags[name]
    return flag_defaults(self.binary()).get(name, "")

  def port(self, name):
    for p in self.spec.get("ports", []):
      if p.get("name") == name:
        return p["containerPort"]
    return None

  def mounts(self):
    return {m["mountPath"]: m for m in self.spec.get("volumeMounts", [])}


class Rendering:

  def __init__(self, name, docs):
    self.name, self.docs = name, [d for d in docs if d]
    self.by_kind = {}
    for d in self.docs:
      self.by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d

  def kind(self, kind):
    return self.by_kind.get(kind, {})

  def configmap(self, name, what):
    if name not in self.kind("ConfigMap"):
      raise AssertionError("%s: ConfigMap %s is not in the rendering (a name kustomize did not "
                           "rewrite?)" % (what, name))
    return self.kind("ConfigMap")[name]

  def workloads(self):
    """(owner, pod) for every Deployment's pod template and every bare Pod."""
    out = [(d, d["spec"]["template"]) for d in self.kind("Deployment").values()]
    return out + [(p, p) for p in self.kind("Pod").values()]

  def containers(self, with_init=False):
    out = []
    for owner, pod in self.workloads():
      out += [Container(self, owner, pod, c) for c in pod["spec"]["containers"]]
      if with_init:
        out += [Container(self, owner, pod, c, init=True)
                for c in pod["spec"].get("initContainers", [])]
    return out

  def nodes(self, role=None):
    return [c for c in self.containers() if c.role and (role is None or c.role == role)]

  def services_for(self, pod):
    labels = pod["metadata"].get("labels", {})
    return [s for s in self.kind("Service").values()
            if selects(s["spec"].get("selector", {}), labels)]


# ---- the tests ------------------------------------------------------------------------------

class K8sRenderTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    cls.kubectl = find_kubectl()
    cls.renderings = {}
    cls.tmp = tempfile.mkdtemp(prefix="kvwire-k8s-")
    k8s = os.path.join(cls.tmp, "k8s")
    shutil.copytree(os.path.join(REPO, "deploy", "k8s"), k8s)
    os.makedirs(os.path.join(k8s, RENDERINGS["cert-manager"]))
    with open(os.path.join(k8s, RENDERINGS["cert-manager"], "kustomization.yaml"), "w") as f:
      f.write(CERT_MANAGER_OVERLAY)
    for name, path in RENDERINGS.items():
      where = os.path.join(REPO, path) if path.startswith("deploy/") else os.path.join(k8s, path)
      r = subprocess.run([cls.kubectl, "kustomize", where],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
      if r.returncode != 0:
        raise AssertionError("kubectl kustomize %s failed:\n%s" % (path, r.stderr))
      cls.renderings[name] = Rendering(name, list(yaml.safe_load_all(r.stdout)))
    for path in [os.path.join(BUILD, p) for _, p in BINARIES.values()]:
      if not os.access(path, os.X_OK):
        raise RuntimeError("%s not found: run 'bash scripts/build.sh'" % path)

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.tmp, ignore_errors=True)

  def all_nodes(self, role=None):
    """(rendering, container) for every kvwire container of every rendering."""
    out = []
    for r in self.renderings.values():
      nodes = r.nodes(role)
      self.assertTrue(nodes, "%s: no %s container" % (r.name, role or "kvwire"))
      out += [(r, c) for c in nodes]
    return out

  # -- the copies ---------------------------------------------------------------------------

  def test_base_copies_are_current(self):
    r = subprocess.run([os.path.join(REPO, "deploy", "k8s", "sync.sh"), "--check"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.assertEqual(r.returncode, 0, r.stdout)

  # -- flags ----------------------------------------------------------------------------------

  def test_binaries_accept_the_flags(self):
    for _, c in self.all_nodes():
      with self.subTest(node=c.what):
        self.assertFalse(c.unresolved, "%s: env the test cannot resolve: %s" % (c.what,
                                                                               c.unresolved))
        left = [a for a in c.argv if re.search(r"\$\([A-Za-z_][A-Za-z0-9_]*\)", a)]
        self.assertFalse(left, "%s: variables no env or ConfigMap defines (the kubelet would pass "
                         "them as written): %s" % (c.what, left))
        r = subprocess.run([c.binary()] + c.argv[1:] + ["--dry-run"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, "%s: %s --dry-run rejects its flags:\n  %s\n%s"
                         % (c.what, c.binary_name, " ".join(c.argv), r.stdout))

  def test_node_flags_reach_the_containers(self):
    """Every ROLE_* key of node-flags.env reaches its role's containers as the same flag and
    value that deploy/local/cluster.sh passes, so the two deployments behave alike."""
    for _, c in self.all_nodes():
      with self.subTest(node=c.what):
        for flag, value in node_flags(c.role).items():
          self.assertEqual(c.flags.get(flag), value,
                           "%s: node-flags.env has %s_%s=%s, but the container passes %s"
                           % (c.what, c.role.upper(), flag.upper().replace("-", "_"), value,
                              "--%s=%s" % (flag, c.flags[flag]) if flag in c.flags
                              else "no --" + flag))

  # -- ports, probes, Services, scraping ----------------------------------------------------

  def test_ports_agree(self):
    for r, c in self.all_nodes():
      with self.subTest(node=c.what):
        grpc = port_of(c.flag("listen"), c.what + " --listen")
        metrics = port_of(c.flag("metrics-listen"), c.what + " --metrics-listen")
        self.assertEqual(c.port("grpc"), grpc, "%s: containerPort named grpc %s, but the binary "
                         "listens on %d" % (c.what, c.port("grpc"), grpc))
        self.assertEqual(c.port("metrics"), metrics, "%s: containerPort named metrics %s, but "
                         "--metrics-listen is on %d" % (c.what, c.port("metrics"), metrics))
        tls = bool(c.flag("tls-cert"))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
          spec = c.spec.get(probe)
          if probe != "startupProbe":
            self.assertTrue(spec, "%s: no %s" % (c.what, probe))
          if spec and tls:
            # The kubelet's gRPC probe is plaintext without a client certificate: against a
            # TLS port it fails, and the pod never gets ready.
            self.assertIn("tcpSocket", spec, "%s: the gRPC port serves TLS, so %s should be a "
                          "tcpSocket probe, has %s" % (c.what, probe, sorted(spec)))
            port = spec["tcpSocket"].get("port")
            self.assertEqual(c.port(port) if isinstance(port, str) else port, grpc,
                             "%s: %s checks port %s, the gRPC server is on %d" % (
                                 c.what, probe, port, grpc))
          elif spec:
            self.assertIn("grpc", spec, "%s: %s should ask grpc.health.v1 (a grpc probe), has %s"
                          % (c.what, probe, sorted(spec)))
            self.assertEqual(spec["grpc"].get("port"), grpc, "%s: %s checks port %s, the gRPC "
                             "server is on %d" % (c.what, probe, spec["grpc"].get("port"), grpc))
            self.assertIn(spec["grpc"].get("service", ""), ("",),
                          "%s: %s asks for a named health service" % (c.what, probe))
        services = r.services_for(c.pod)
        self.assertTrue(services, "%s: no Service selects these pods" % c.what)
        ports = {p["name"]: p["containerPort"] for p in c.spec.get("ports", []) if "name" in p}
        for svc in services:
          for sp in svc["spec"]["ports"]:
            target = sp.get("targetPort", sp["port"])
            number = ports.get(target) if isinstance(target, str) else target
            self.assertIn(number, ports.values(), "%s: Service %s port %s targets %r, which is no "
                          "port of the container" % (c.what, svc["metadata"]["name"],
                                                     sp.get("name"), target))
            if sp.get("name") in ("grpc", "metrics"):
              self.assertEqual(number, {"grpc": grpc, "metrics": metrics}[sp["name"]],
                               "%s: Service %s port %s targets %s" % (
                                   c.what, svc["metadata"]["name"], sp["name"], number))
            if tls and number == grpc:
              self.assertNotEqual(sp.get("appProtocol"), "kubernetes.io/h2c", "%s: Service %s "
                                  "calls the TLS port %s h2c (plaintext HTTP/2)" % (
                                      c.what, svc["metadata"]["name"], sp.get("name")))
        notes = c.pod["metadata"].get("annotations", {})
        self.assertEqual(notes.get("prometheus.io/scrape"), "true", c.what + ": not scraped")
        self.assertEqual(notes.get("prometheus.io/port"), str(metrics), "%s: the scrape "
                         "annotation says port %s, /metrics is on %d" % (
                             c.what, notes.get("prometheus.io/port"), metrics))
        self.assertEqual(notes.get("prometheus.io/path", "/metrics"), "/metrics", c.what)

  def test_decode_nodes_find_the_prefill_service(self):
    for r, c in self.all_nodes("decode"):
      with self.subTest(node=c.what):
        target = c.flag("prefill")
        m = re.match(r"^dns:///([a-z0-9-]+)(\.[a-z0-9-]+(\.svc(\.cluster\.local)?)?)?:(\d+)$",
                     target)
        self.assertTrue(m, "%s: --prefill=%r is not dns:///SERVICE[.NAMESPACE...]:PORT"
                        % (c.what, target))
        name, port = m.group(1), int(m.group(5))
        svc = r.kind("Service").get(name)
        self.assertTrue(svc, "%s: --prefill names Service %s, which the rendering does not have "
                        "(has %s)" % (c.what, name, sorted(r.kind("Service"))))
        self.assertEqual(svc["spec"].get("clusterIP"), "None", "%s: Service %s must be headless "
                         "(clusterIP: None) for gRPC's round robin to see every prefill pod"
                         % (c.what, name))
        prefill = r.nodes("prefill")
        selected = [p for p in prefill if selects(svc["spec"].get("selector", {}),
                                                  p.pod["metadata"].get("labels", {}))]
        self.assertEqual(len(selected), len(prefill), "%s: Service %s does not select the prefill "
                         "pods" % (c.what, name))
        self.assertFalse(selects(svc["spec"].get("selector", {}),
                                 c.pod["metadata"].get("labels", {})),
                         "%s: Service %s selects the decode pods too" % (c.what, name))
        by_port = {sp["port"]: sp for sp in svc["spec"]["ports"]}
        self.assertIn(port, by_port, "%s: Service %s has no port %d" % (c.what, name, port))
        for p in selected:
          target = by_port[port].get("targetPort", port)
          number = p.port(target) if isinstance(target, str) else target
          self.assertEqual(number, port_of(p.flag("listen"), p.what),
                           "%s: Service %s port %d reaches %s, the prefill node listens on %s"
                           % (c.what, name, port, number, p.flag("listen")))

  # -- mutual TLS between decode and prefill, and who may reach the prefill pods ---------------

  def secret_file(self, c, flag):
    """(Secret name, key, volume) that the file named by `flag` of container c comes from;
    fails unless it is a key of a kubernetes.io/tls Secret mounted read-only."""
    path = c.flag(flag)
    self.assertTrue(path, "%s: no --%s" % (c.what, flag))
    mount = max((m for p, m in c.mounts().items() if path.startswith(p.rstrip("/") + "/")),
                key=lambda m: len(m["mountPath"]), default=None)
    self.assertTrue(mount, "%s: --%s=%s is on no volume" % (c.what, flag, path))
    self.assertIs(mount.get("readOnly"), True, "%s: the volume of --%s is not mounted readOnly"
                  % (c.what, flag))
    volume = next(v for v in c.pod["spec"]["volumes"] if v["name"] == mount["name"])
    self.assertIn("secret", volume, "%s: --%s=%s is not from a Secret (volume %s)"
                  % (c.what, flag, path, volume))
    key = os.path.relpath(path, mount["mountPath"])
    items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}
    key = items.get(key, key) if items else key
    self.assertIn(key, TLS_KEYS, "%s: --%s=%s is key %r of Secret %s, not one of a "
                  "kubernetes.io/tls Secret's %s" % (c.what, flag, path, key,
                                                     volume["secret"]["secretName"],
                                                     sorted(TLS_KEYS)))
    return volume["secret"]["secretName"], key, volume

  def identities(self, r):
    """{role: Secret name} of the rendering's prefill and decode containers, after checking
    that each takes its certificate, key and CA from one Secret's tls.crt, tls.key, ca.crt."""
    flags = {"prefill": {"tls-cert": "tls.crt", "tls-key": "tls.key", "tls-client-ca": "ca.crt"},
             "decode": {"prefill-tls-cert": "tls.crt", "prefill-tls-key": "tls.key",
                        "prefill-tls-ca": "ca.crt"}}
    out = {}
    for role, want in flags.items():
      for c in r.nodes(role):
        secrets = set()
        for flag, key in want.items():
          secret, got, volume = self.secret_file(c, flag)
          self.assertEqual(got, key, "%s: --%s reads %s of Secret %s" % (c.what, flag, got,
                                                                         secret))
          mode = volume["secret"].get("defaultMode", 0o644)
          self.assertEqual(mode & 0o007, 0, "%s: Secret %s is mounted readable by any user "
                           "(defaultMode %o)" % (c.what, secret, mode))
          secrets.add(secret)
        self.assertEqual(len(secrets), 1, "%s: certificate, key and CA from different Secrets "
                         "%s" % (c.what, sorted(secrets)))
        out.setdefault(role, set()).update(secrets)
    for role in flags:
      self.assertEqual(len(out.get(role, ())), 1, "%s: the %s pods use Secrets %s"
                       % (r.name, role, sorted(out.get(role, ()))))
      out[role] = out[role].pop()
    self.assertNotEqual(out["prefill"], out["decode"], r.name + ": one Secret for both roles")
    return out

  def checked_name(self, c):
    """The name a decode container checks in the prefill certificate."""
    if c.flag("prefill-tls-server-name"):
      return c.flag("prefill-tls-server-name")
    m = re.match(r"^dns:///([^:/]+):\d+$", c.flag("prefill"))
    self.assertTrue(m, "%s: no --prefill-tls-server-name, and --prefill=%s names no host"
                    % (c.what, c.flag("prefill")))
    return m.group(1)

  def test_mutual_tls_between_decode_and_prefill(self):
    for r in self.renderings.values():
      with self.subTest(rendering=r.name):
        # identities() fails for any prefill container without the three TLS flags: a server
        # certificate and a client CA (without which any client, certificate or not, is served).
        self.identities(r)
        for c in r.nodes("prefill"):
          # --insecure would let a prefill node on a pod address serve plaintext; reflection
          # would describe its API to anyone who connects.
          self.assertNotIn("insecure", c.flags, c.what + ": --insecure")
          self.assertNotIn(c.flags.get("reflection", "false"), ("true", "1"),
                           c.what + ": --reflection")
        for c in r.nodes("decode"):
          self.assertTrue(self.checked_name(c), c.what)

  def test_prefill_network_policy(self):
    """Only decode pods reach the prefill pods' gRPC port; their /metrics stays reachable."""
    for r in self.renderings.values():
      with self.subTest(rendering=r.name):
        prefill = r.nodes("prefill")
        grpc_port = port_of(prefill[0].flag("listen"), prefill[0].what)
        metrics_port = port_of(prefill[0].flag("metrics-listen"), prefill[0].what)
        decode_ids = {id(c.pod) for c in r.nodes("decode")}
        decode_pods = [pod for _, pod in r.workloads() if id(pod) in decode_ids]
        other_pods = [pod for _, pod in r.workloads() if id(pod) not in decode_ids]
        self.assertTrue(decode_pods, r.name + ": no decode pods")
        policies = [np for np in r.kind("NetworkPolicy").values()
                    if all(label_selector_matches(np["spec"].get("podSelector", {}),
                                                  p.pod["metadata"].get("labels", {}))
                           for p in prefill)]
        self.assertTrue(policies, "%s: no NetworkPolicy selects the prefill pods (has %s)"
                        % (r.name, sorted(r.kind("NetworkPolicy"))))
        ingress = [np for np in policies
                   if "Ingress" in np["spec"].get("policyTypes", ["Ingress"])]
        self.assertTrue(ingress, "%s: no NetworkPolicy of the prefill pods restricts ingress"
                        % r.name)
        opens = {grpc_port: [], metrics_port: []}
        for np in ingress:
          name = np["metadata"]["name"]
          for rule in np["spec"].get("ingress", []):
            ports = set()
            for p in rule.get("ports") or [{}]:
              if "port" not in p:  # every port
                ports.update(opens)
                continue
              self.assertEqual(p.get("protocol", "TCP"), "TCP", name)
              port = p["port"]
              number = prefill[0].port(port) if isinstance(port, str) else int(port)
              end = p.get("endPort", number)
              ports.update(q for q in opens if number <= q <= end)
            for port in ports:
              opens[port].append((name, rule.get("from")))
        self.assertTrue(opens[grpc_port], "%s: the NetworkPolicy lets nothing reach the prefill "
                        "gRPC port %d: decode pods cannot prefill" % (r.name, grpc_port))
        for name, peers in opens[grpc_port]:
          self.assertTrue(peers, "%s: NetworkPolicy %s opens the prefill gRPC port %d to any "
                          "source" % (r.name, name, grpc_port))
          for peer in peers:
            self.assertEqual(sorted(peer), ["podSelector"], "%s: NetworkPolicy %s opens the "
                             "prefill gRPC port to %s, beyond this namespace's pods"
                             % (r.name, name, peer))
            selected = lambda pod: label_selector_matches(peer["podSelector"],
                                                          pod["metadata"].get("labels", {}))
            self.assertTrue(all(selected(p) for p in decode_pods), "%s: NetworkPolicy %s: the "
                            "peer %s does not select every decode pod" % (r.name, name, peer))
            stray = [p["metadata"].get("labels", {}) for p in other_pods if selected(p)]
            self.assertFalse(stray, "%s: NetworkPolicy %s lets pods other than decode pods "
                             "reach the prefill gRPC port: %s" % (r.name, name, stray))
        self.assertTrue(
            any(not peers or any("namespaceSelector" in p or "ipBlock" in p for p in peers)
                for _, peers in opens[metrics_port]),
            "%s: the NetworkPolicy keeps a Prometheus outside the kvwire pods from the prefill "
            "pods' /metrics on %d" % (r.name, metrics_port))

  def test_cert_manager_issues_the_secrets(self):
    r = self.renderings["cert-manager"]
    ids = self.identities(r)
    certs = {c["spec"]["secretName"]: c for c in r.kind("Certificate").values()}
    for role, usage in (("prefill", "server auth"), ("decode", "client auth")):
      cert = certs.get(ids[role])
      self.assertTrue(cert, "no Certificate writes the Secret %s that the %s pods mount (has %s)"
                      % (ids[role], role, sorted(certs)))
      self.assertIn(usage, cert["spec"].get("usages", []), "Certificate %s" % ids[role])
      self.assertFalse(cert["spec"].get("isCA"), "Certificate %s" % ids[role])
    for c in r.nodes("decode"):
      name = self.checked_name(c)
      self.assertIn(name, certs[ids["prefill"]]["spec"].get("dnsNames", []), "%s checks the "
                    "name %s, which the prefill Certificate does not carry" % (c.what, name))
    # One CA issuer signs both, so each Secret's ca.crt is the CA of the other side.
    refs = {json.dumps(certs[ids[role]]["spec"]["issuerRef"], sort_keys=True) for role in ids}
    self.assertEqual(len(refs), 1, "the two Certificates have different issuers: %s" % refs)
    ref = certs[ids["prefill"]]["spec"]["issuerRef"]
    issuer = r.kind(ref.get("kind", "Issuer")).get(ref["name"])
    self.assertTrue(issuer, "issuer %s is not in the rendering" % ref)
    self.assertIn("ca", issuer["spec"], "issuer %s is not a CA issuer" % ref["name"])
    ca = certs.get(issuer["spec"]["ca"]["secretName"])
    self.assertTrue(ca and ca["spec"].get("isCA"), "the CA issuer's Secret %s is no CA "
                    "Certificate" % issuer["spec"]["ca"]["secretName"])

  def test_tls_secrets_script(self):
    """deploy/k8s/tls-secrets.sh --print: the Secrets the pods mount, in kubernetes.io/tls
    shape, each side's ca.crt the CA of the other's certificate, the prefill certificate
    carrying the name the decode nodes check."""
    if not shutil.which("openssl"):
      self.skipTest("openssl is not installed")
    certs = os.path.join(self.tmp, "tls-secrets")
    env = dict(os.environ, KVWIRE_KUBECTL=self.kubectl, KUBECONFIG=os.devnull)
    r = subprocess.run([os.path.join(REPO, "deploy", "k8s", "tls-secrets.sh"), "--print",
                        "--certs", certs], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, env=env, timeout=60)
    self.assertEqual(r.returncode, 0, r.stderr)
    secrets = {d["metadata"]["name"]: d for d in yaml.safe_load_all(r.stdout) if d}
    ids = self.identities(self.renderings["base"])
    self.assertEqual(sorted(secrets), sorted(ids.values()))
    files = {}
    for role, name in ids.items():
      secret = secrets[name]
      self.assertEqual(secret.get("type"), "kubernetes.io/tls", name)
      self.assertEqual(set(secret["data"]), TLS_KEYS, name)
      for key, value in secret["data"].items():
        files[role, key] = os.path.join(self.tmp, "%s-%s" % (role, key))
        with open(files[role, key], "wb") as f:
          f.write(base64.b64decode(value))
    for server, client in (("prefill", "decode"), ("decode", "prefill")):
      v = subprocess.run(["openssl", "verify", "-CAfile", files[client, "ca.crt"],
                          files[server, "tls.crt"]], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
      self.assertEqual(v.returncode, 0, "the %s certificate against the %s Secret's ca.crt: %s"
                       % (server, client, v.stdout))
    for c in self.renderings["base"].nodes("decode"):
      name = self.checked_name(c)
      check = subprocess.run(["openssl", "x509", "-in", files["prefill", "tls.crt"], "-noout",
                              "-checkhost", name], stdout=subprocess.PIPE, text=True)
      self.assertIn("does match", check.stdout, "%s checks %s: %s" % (c.what, name,
                                                                      check.stdout))

  # -- the router -----------------------------------------------------------------------------

  def router(self, r):
    routers = [c for c in r.containers() if os.path.basename(c.spec.get("command", [""])[0])
               == "nginx"]
    self.assertEqual(len(routers), 1, "%s: expected one nginx container" % r.name)
    c = routers[0]
    args = c.argv[1:]
    opts = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i] in ("-c", "-p", "-e")}
    self.assertIn("-c", opts, c.what + ": nginx needs -c CONFIG")
    self.assertIn("-p", opts, c.what + ": nginx needs -p PREFIX (a writable folder)")
    conf_dir, conf_file = os.path.split(opts["-c"])
    mount = c.mounts().get(conf_dir)
    self.assertTrue(mount, "%s: nothing is mounted at %s for -c %s" % (c.what, conf_dir,
                                                                       opts["-c"]))
    volume = next(v for v in c.pod["spec"]["volumes"] if v["name"] == mount["name"])
    self.assertIn("configMap", volume, c.what + ": the config volume is not a ConfigMap")
    data = r.configmap(volume["configMap"]["name"], c.what).get("data", {})
    self.assertIn(conf_file, data, "%s: ConfigMap %s has no %s" % (
        c.what, volume["configMap"]["name"], conf_file))
    return c, opts, data[conf_file]

  def test_router_config(self):
    for r in self.renderings.values():
      with self.subTest(rendering=r.name):
        c, opts, conf = self.router(r)
        servers = re.findall(r"^\s*server\s+([A-Za-z0-9.-]+):(\d+)\b", conf, re.M)
        self.assertTrue(servers, c.what + ": nginx.conf has no upstream server")
        decode = r.nodes("decode")
        for host, port in servers:
          name = host.split(".")[0]
          svc = r.kind("Service").get(name)
          self.assertTrue(svc, "%s: the upstream %s:%s names no Service of the rendering (has "
                          "%s)" % (c.what, host, port, sorted(r.kind("Service"))))
          self.assertNotEqual(svc["spec"].get("clusterIP"), "None", "%s: upstream %s is a "
                              "headless Service: open-source nginx resolves it once, at start"
                              % (c.what, name))
          for d in decode:
            self.assertTrue(selects(svc["spec"].get("selector", {}),
                                    d.pod["metadata"].get("labels", {})),
                            "%s: upstream Service %s does not select %s" % (c.what, name,
                                                                            d.what))
            sp = next((p for p in svc["spec"]["ports"] if p["port"] == int(port)), None)
            self.assertTrue(sp, "%s: Service %s has no port %s" % (c.what, name, port))
            target = sp.get("targetPort", sp["port"])
            number = d.port(target) if isinstance(target, str) else target
            self.assertEqual(number, port_of(d.flag("listen"), d.what), "%s: %s:%s reaches "
                             "port %s of the decode pods, which listen on %s" % (
                                 c.what, host, port, number, d.flag("listen")))
        listen = re.findall(r"^\s*listen\s+(?:[^\s;]*:)?(\d+)\b", conf, re.M)
        self.assertEqual(len(listen), 1, c.what + ": expected one listen directive")
        self.assertEqual(c.port("grpc"), int(listen[0]), "%s: nginx listens on %s, the "
                         "containerPort grpc is %s" % (c.what, listen[0], c.port("grpc")))
        probe = c.spec.get("readinessProbe", {})
        self.assertEqual(probe.get("grpc", {}).get("port"), int(listen[0]),
                         c.what + ": readiness should be a grpc probe through nginx")
        self.assertTrue(c.spec.get("livenessProbe"), c.what + ": no livenessProbe")
        svcs = r.services_for(c.pod)
        self.assertTrue(svcs, c.what + ": no Service selects the router")
        for svc in svcs:
          for sp in svc["spec"]["ports"]:
            target = sp.get("targetPort", sp["port"])
            number = c.port(target) if isinstance(target, str) else target
            self.assertEqual(number, int(listen[0]), "%s: Service %s targets %s" % (
                c.what, svc["metadata"]["name"], number))
        # Everything nginx writes must be on a writable volume (the root file system is not).
        prefix = opts["-p"].rstrip("/")
        run = c.mounts().get(prefix)
        self.assertTrue(run and not run.get("readOnly"), c.what + ": the prefix %s is not a "
                        "writable mount" % prefix)
        paths = re.findall(r"^\s*(?:pid|\w+_temp_path)\s+(\S+?);", conf, re.M)
        paths += [p for p in re.findall(r"^\s*(?:access|error)_log\s+(\S+)", conf, re.M)
                  if p not in ("/dev/stdout", "/dev/stderr", "off")]
        paths += [opts["-e"]] if opts.get("-e", "/dev/stderr") != "/dev/stderr" else []
        for p in paths:
          self.assertTrue(p.startswith(prefix + "/"), "%s: nginx writes %s, outside the "
                          "writable prefix %s" % (c.what, p, prefix))
        # Drain: the stop signal is SIGQUIT (the image's), which waits worker_shutdown_timeout.
        m = re.search(r"^\s*worker_shutdown_timeout\s+(\d+)s;", conf, re.M)
        shutdown_s = int(m.group(1)) if m else 0
        grace = c.pod["spec"].get("terminationGracePeriodSeconds", 30)
        self.assertGreater(grace, self.prestop_seconds(c) + shutdown_s, "%s: "
                           "terminationGracePeriodSeconds %d <= preStop %d s + nginx's "
                           "worker_shutdown_timeout %d s" % (c.what, grace,
                                                             self.prestop_seconds(c), shutdown_s))

  def test_router_config_passes_nginx_t(self):
    nginx = shutil.which(os.environ.get("KVWIRE_NGINX", "nginx")) or shutil.which("/usr/sbin/nginx")
    if not nginx:
      self.skipTest("nginx is not installed")
    _, opts, conf = self.router(self.renderings["base"])
    with tempfile.TemporaryDirectory(prefix="kvwire-nginx-t-") as tmp:
      # The Service names do not resolve here, and the prefix is the pod's: swap both.
      local = conf.replace(opts["-p"].rstrip("/"), tmp)
      local = re.sub(r"^(\s*server\s+)[A-Za-z0-9.-]+:", r"\g<1>127.0.0.1:", local, flags=re.M)
      os.makedirs(os.path.join(tmp, "logs"))
      with open(os.path.join(tmp, "nginx.conf"), "w") as f:
        f.write(local)
      cmd = [nginx, "-t", "-q", "-p", tmp, "-e", os.path.join(tmp, "logs", "error.log"),
             "-c", os.path.join(tmp, "nginx.conf")]
      if os.geteuid() == 0:
        cmd += ["-g", "user root;"]
      r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      self.assertEqual(r.returncode, 0, "nginx -t rejects the router's nginx.conf:\n" + r.stdout)

  # -- resources, security, drain, model ----------------------------------------------------

  def test_resources_and_security(self):
    for r in self.renderings.values():
      for c in r.containers(with_init=True):
        with self.subTest(container=c.what):
          res = c.spec.get("resources", {})
          for kind in ("requests", "limits"):
            for resource in ("cpu", "memory"):
              self.assertIn(resource, res.get(kind, {}), "%s: no %s.%s" % (c.what, kind,
                                                                           resource))
          self.assertLessEqual(cpu_quantity(res["requests"]["cpu"]),
                               cpu_quantity(res["limits"]["cpu"]), c.what + ": cpu")
          self.assertLessEqual(memory_quantity(res["requests"]["memory"]),
                               memory_quantity(res["limits"]["memory"]), c.what + ": memory")
          pod_sc = c.pod["spec"].get("securityContext", {})
          sc = c.spec.get("securityContext", {})
          self.assertTrue(sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")),
                          c.what + ": runAsNonRoot is not set")
          self.assertNotEqual(sc.get("runAsUser", pod_sc.get("runAsUser", 0)), 0,
                              c.what + ": runs as uid 0")
          self.assertIs(sc.get("readOnlyRootFilesystem"), True,
                        c.what + ": readOnlyRootFilesystem is not true")
          self.assertIs(sc.get("allowPrivilegeEscalation"), False,
                        c.what + ": allowPrivilegeEscalation is not false")
          if c.role == "decode":
            pool = kvwire_bytes(c.flag("kv-pool-bytes"))
            self.assertGreater(memory_quantity(res["limits"]["memory"]), pool,
                               "%s: memory limit %s does not hold --kv-pool-bytes=%s"
                               % (c.what, res["limits"]["memory"], c.flag("kv-pool-bytes")))

  @staticmethod
  def prestop_seconds(c):
    pre = c.spec.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
      return int(pre["sleep"]["seconds"])
    cmd = pre.get("exec", {}).get("command", [])
    if len(cmd) == 2 and os.path.basename(cmd[0]) == "sleep":
      return int(cmd[1])
    return 0

  def test_drain_fits_the_grace_period(self):
    for _, c in self.all_nodes():
      with self.subTest(node=c.what):
        pre = self.prestop_seconds(c)
        self.assertGreater(pre, 0, c.what + ": no preStop sleep (endpoints need time to drop the "
                           "pod before SIGTERM)")
        grace_ms = int(c.flag("grace-ms"))
        period = c.pod["spec"].get("terminationGracePeriodSeconds", 30)
        self.assertGreater(period * 1000, pre * 1000 + grace_ms,
                           "%s: terminationGracePeriodSeconds %d is not more than preStop %d s "
                           "+ --grace-ms %d: SIGKILL would cut the drain short"
                           % (c.what, period, pre, grace_ms))

  def test_model_volume(self):
    for r, c in self.all_nodes():
      with self.subTest(node=c.what):
        model = c.flag("model")
        if model.startswith("synthetic:"):
          continue
        mount = max((m for p, m in c.mounts().items() if model == p or model.startswith(p + "/")),
                    key=lambda m: len(m["mountPath"]), default=None)
        self.assertTrue(mount, "%s: --model=%s is on no volume" % (c.what, model))
        self.assertEqual(mount["mountPath"], "/models", c.what)
        self.assertIs(mount.get("readOnly"), True, c.what + ": the model volume is writable")
        volume = next(v for v in c.pod["spec"]["volumes"] if v["name"] == mount["name"])
        claim = volume.get("persistentVolumeClaim", {})
        self.assertEqual(claim.get("claimName"), MODEL_CLAIM, "%s: model volume %s" % (c.what,
                                                                                       volume))
        self.assertIs(claim.get("readOnly"), True, c.what + ": the claim is not mounted readOnly")

  # -- what each overlay is for ----------------------------------------------------------------

  def test_overlays(self):
    # The gpu overlay schedules the CUDA image on GPU nodes; the engine runs its CPU backend
    # (kvwire refuses --backend=cuda until the model is device-resident).
    expect = {"base": ("cpu", "cpu"), "cpu-demo": ("cpu", "cpu"), "gpu": ("gpu", "cpu"),
              "cert-manager": ("cpu", "cpu")}
    for r, c in self.all_nodes():
      with self.subTest(node=c.what):
        tag, backend = expect[r.name]
        self.assertEqual(c.spec["image"], "kvwire:" + tag, c.what)
        self.assertEqual(c.flag("backend"), backend, c.what + ": --backend")
        gpus = c.spec.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        tolerated = any(t.get("key") == "nvidia.com/gpu"
                        for t in c.pod["spec"].get("tolerations", []))
        if r.name == "gpu":
          self.assertTrue(gpus and int(gpus) >= 1, c.what + ": no nvidia.com/gpu limit")
          self.assertTrue(tolerated, c.what + ": does not tolerate the nvidia.com/gpu taint")
        else:
          self.assertIsNone(gpus, c.what + ": asks for a GPU")
        if r.name == "cpu-demo":
          self.assertEqual(c.flag("threads"), "1", c.what + ": --threads")
          self.assertEqual(os.path.basename(c.flag("model")), "stories260K-hf", c.what)
    demo = self.renderings["cpu-demo"]
    self.assertIn(MODEL_CLAIM, demo.kind("PersistentVolumeClaim"),
                  "cpu-demo: creates no PersistentVolumeClaim %s" % MODEL_CLAIM)

  # -- Prometheus -----------------------------------------------------------------------------

  def fake_pod_discovery(self, rendering):
    """File-SD target groups carrying the labels Prometheus's kubernetes_sd (role: pod) gives
    the rendered pods: one target per container port, as it does."""
    groups, expected = [], {}
    sanitize = lambda s: re.sub(r"[^a-zA-Z0-9_]", "_", s)
    ip = 10
    for owner, pod in rendering.workloads():
      replicas = owner["spec"].get("replicas", 1) if owner["kind"] == "Deployment" else 1
      for i in range(replicas):
        ip += 1
        pod_ip = "10.1.0.%d" % ip
        name = "%s-%d" % (owner["metadata"]["name"], i)
        meta = pod["metadata"]
        base = {"__meta_kubernetes_namespace": "kvwire", "__meta_kubernetes_pod_name": name,
                "__meta_kubernetes_pod_ip": pod_ip, "__meta_kubernetes_pod_phase": "Running",
                "__meta_kubernetes_pod_ready": "true",
                "__meta_kubernetes_pod_node_name": "node-1",
                "__meta_kubernetes_pod_controller_kind": "ReplicaSet"}
        for k, v in meta.get("labels", {}).items():
          base["__meta_kubernetes_pod_label_" + sanitize(k)] = v
          base["__meta_kubernetes_pod_labelpresent_" + sanitize(k)] = "true"
        for k, v in meta.get("annotations", {}).items():
          base["__meta_kubernetes_pod_annotation_" + sanitize(k)] = v
          base["__meta_kubernetes_pod_annotationpresent_" + sanitize(k)] = "true"
        for c in pod["spec"]["containers"]:
          for port in c.get("ports", []) or [None]:
            labels = dict(base, __meta_kubernetes_pod_container_name=c["name"],
                          __meta_kubernetes_pod_container_init="false")
            address = pod_ip
            if port:
              address = "%s:%d" % (pod_ip, port["containerPort"])
              labels.update({"__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                             "__meta_kubernetes_pod_container_port_number":
                                 str(port["containerPort"]),
                             "__meta_kubernetes_pod_container_port_protocol":
                                 port.get("protocol", "TCP")})
            groups.append({"targets": [address], "labels": labels})
          base_name = os.path.basename(c.get("command", [""])[0])
          if base_name in BINARIES:
            node = Container(rendering, owner, pod, c)
            metrics = port_of(node.flag("metrics-listen"), node.what)
            expected[name] = "%s:%d" % (pod_ip, metrics)
    return groups, expected

  def test_prometheus_scrapes_each_node_once(self):
    promtool = shutil.which(os.environ.get("KVWIRE_PROMTOOL", "promtool"))
    if not promtool:
      self.skipTest("promtool is not installed (Debian: prometheus)")
    with open(os.path.join(REPO, "deploy", "k8s", "prometheus", "prometheus.yml")) as f:
      config = yaml.safe_load(f)
    jobs = [j for j in config["scrape_configs"] if j.get("kubernetes_sd_configs")]
    self.assertEqual(len(jobs), 1, "expected one scrape job with kubernetes_sd_configs")
    job = jobs[0]
    self.assertEqual([sd.get("role") for sd in job["kubernetes_sd_configs"]], ["pod"])
    tmp = tempfile.mkdtemp(prefix="kvwire-sd-")
    self.addCleanup(shutil.rmtree, tmp, True)
    runs = {}
    for r in self.renderings.values():
      groups, expected = self.fake_pod_discovery(r)
      sd_file = os.path.join(tmp, r.name + ".json")
      with open(sd_file, "w") as f:
        json.dump(groups, f)
      # Debian's Prometheus is built without Kubernetes discovery: the same job and
      # relabeling, fed by a file with what kubernetes_sd would find.
      local = dict(config, scrape_configs=[dict(
          {k: v for k, v in job.items() if k != "kubernetes_sd_configs"},
          file_sd_configs=[{"files": [sd_file]}])])
      path = os.path.join(tmp, r.name + ".yml")
      with open(path, "w") as f:
        yaml.safe_dump(local, f)
      check = subprocess.run([promtool, "check", "config", path], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
      self.assertEqual(check.returncode, 0, check.stdout)
      # promtool waits --timeout for discovery, then reports: run the three at once.
      runs[r.name] = (expected, subprocess.Popen(
          [promtool, "check", "service-discovery", "--timeout=3s", path, job["job_name"]],
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for name, (expected, proc) in runs.items():
      with self.subTest(rendering=name):
        out, err = proc.communicate(timeout=60)
        self.assertEqual(proc.returncode, 0, err)
        kept = [t["labels"] for t in json.loads(out) if t["labels"]]
        # Prometheus scrapes targets with equal labels once.
        unique = {json.dumps(t, sort_keys=True): t for t in kept}.values()
        got = sorted("%s %s%s" % (t.get("pod"), t["__address__"], t["__metrics_path__"])
                     for t in unique)
        want = sorted("%s %s/metrics" % (pod, address) for pod, address in expected.items())
        self.assertEqual(got, want, "scrape targets from deploy/k8s/prometheus/prometheus.yml")
        for t in unique:
          clash = {"role", "node"} & set(t)
          self.assertFalse(clash, "target label %s would rename kvwire's own label to "
                           "exported_*" % clash)

  def test_local_prometheus_template(self):
    with open(os.path.join(REPO, "deploy", "prometheus", "local.yml.template")) as f:
      conf = f.read()
    placeholders = set(re.findall(r"@([A-Z0-9_]+)@", conf.split("\nglobal:", 1)[1]))
    self.assertEqual(placeholders, {"HOST", "SCRAPE_INTERVAL", "PREFILL0_METRICS_PORT",
                                    "PREFILL1_METRICS_PORT", "DECODE0_METRICS_PORT",
                                    "DECODE1_METRICS_PORT"})
    promtool = shutil.which(os.environ.get("KVWIRE_PROMTOOL", "promtool"))
    if not promtool:
      self.skipTest("promtool is not installed (Debian: prometheus)")
    for i, name in enumerate(sorted(placeholders)):
      conf = conf.replace("@%s@" % name, {"HOST": "127.0.0.1", "SCRAPE_INTERVAL": "5s"}
                          .get(name, str(9101 + i)))
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
      f.write(conf)
      f.flush()
      r = subprocess.run([promtool, "check", "config", f.name], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    self.assertEqual(r.returncode, 0, r.stdout)

  # -- images ---------------------------------------------------------------------------------

  _runtime_packages = None

  def runtime_packages(self):
    """{package: [sonames]} of the Debian packages the binaries' NEEDED libraries come from,
    less the base image's; and the sonames no package owns (the CUDA toolkit's)."""
    if K8sRenderTest._runtime_packages is None:
      libs = {}
      for _, rel in BINARIES.values():
        libs.update(needed_libraries(os.path.join(BUILD, rel)))
      owners = packages_of(libs.values())
      packages, unowned = {}, {}
      for soname, path in libs.items():
        if owners[path] is None:
          unowned[soname] = path
        elif owners[path] not in BASE_IMAGE_PACKAGES:
          packages.setdefault(owners[path], set()).add(soname)
      K8sRenderTest._runtime_packages = (packages, unowned)
    return K8sRenderTest._runtime_packages

  def check_build_stage(self, path, stage, base_pattern):
    image, _, instructions = stage
    self.assertRegex(image, base_pattern, "%s: builder base" % path)
    run = " ".join(t for k, t in instructions if k == "RUN")
    for flag in ("-DKVWIRE_NATIVE=OFF", "-DKVWIRE_BUILD_TESTS=OFF", "-DKVWIRE_BUILD_BENCH=OFF",
                 "-DCMAKE_BUILD_TYPE=Release"):
      self.assertIn(flag, run, "%s: the build does not set %s" % (path, flag))
    # The build reads every folder the top-level CMakeLists.txt adds (tests and bench are off).
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
      top = re.sub(r"if\(KVWIRE_BUILD_(TESTS|BENCH)\).*?endif\(\)", "", f.read(), flags=re.S)
    # KVWIRE_FUZZ is off in the images: its branch (fuzz/) is not built, its else() is.
    top = re.sub(r"if\(KVWIRE_FUZZ\)\s*add_subdirectory\(fuzz\)\s*else\(\)", "", top)
    copied = set()
    for k, t in instructions:
      if k == "COPY" and not t.startswith("--from"):
        copied.update(w.rstrip("/") for w in t.split()[:-1])
    for folder in re.findall(r"add_subdirectory\((\w+)\)", top) + ["CMakeLists.txt"]:
      self.assertIn(folder, copied, "%s: the build needs %s, which is not copied" % (path,
                                                                                    folder))
    packages = set(apt_packages(instructions))
    self.assertTrue(packages, path + ": the builder installs nothing")
    extra = packages - install_deps_packages()
    self.assertFalse(extra, "%s: builder packages that scripts/install_deps.sh does not "
                     "install (a name that drifted?): %s" % (path, sorted(extra)))
    return packages

  def check_runtime_stage(self, path, stage, base_pattern):
    image, _, instructions = stage
    self.assertRegex(image, base_pattern, "%s: runtime base" % path)
    copies = [t for k, t in instructions if k == "COPY" and t.startswith("--from")]
    dests = {}
    for t in copies:
      words = t.split()[1:]
      for src in words[:-1]:
        dests[os.path.basename(src)] = os.path.join(words[-1], os.path.basename(src))
    users = [t for k, t in instructions if k == "USER"]
    self.assertTrue(users, path + ": the image runs as root (no USER)")
    uid = users[-1].split(":")[0]
    manifest_uids = set()
    for r in self.renderings.values():
      for c in r.nodes():
        self.assertEqual(dests.get(c.binary_name), c.spec["command"][0], "%s: %s is copied to "
                         "%s, the manifests run %s" % (path, c.binary_name,
                                                       dests.get(c.binary_name),
                                                       c.spec["command"][0]))
        manifest_uids.add(str(c.pod["spec"].get("securityContext", {}).get("runAsUser")))
    self.assertEqual(manifest_uids, {uid}, "%s: USER %s, the manifests' runAsUser %s"
                     % (path, uid, manifest_uids))
    return apt_packages(instructions)

  def test_dockerfile(self):
    path = os.path.join(REPO, "deploy", "docker", "Dockerfile")
    stages = dockerfile_stages(path)
    names = [s[1] for s in stages]
    self.assertEqual(names[0], "builder", path)
    build_pkgs = self.check_build_stage(path, stages[0], r"^debian:12$")
    run = " ".join(t for k, t in stages[0][2] if k == "RUN")
    self.assertIn("-DKVWIRE_CUDA=OFF", run, path + ": the CPU image is built without CUDA")
    runtime = set(self.check_runtime_stage(path, stages[-1], r"^debian:12-slim$"))
    needed, unowned = self.runtime_packages()
    for pkg, sonames in sorted(needed.items()):
      self.assertIn(pkg, runtime, "%s: the binaries link %s, from %s, which the runtime stage "
                    "does not install" % (path, sorted(sonames), pkg))
    cuda = {s for s in unowned if re.match(r"^lib(cudart|cublas|cublasLt|nccl)\.so", s)}
    self.assertEqual(set(unowned) - cuda, set(), "libraries of no Debian package: %s"
                     % {s: unowned[s] for s in set(unowned) - cuda})
    # The router: Debian's nginx, non-root, stopped gracefully.
    self.assertIn("router", names, path + ": no router stage")
    image, _, router = stages[names.index("router")]
    self.assertEqual(image, "debian:12-slim", path + ": router base")
    self.assertIn("nginx", apt_packages(router), path + ": the router stage has no nginx")
    self.assertIn(("STOPSIGNAL", "SIGQUIT"), router, path + ": nginx stops gracefully on "
                  "SIGQUIT; SIGTERM drops the streams in flight")
    self.assertTrue([t for k, t in router if k == "USER" and not t.startswith("0")],
                    path + ": the router image runs as root")
    for r in self.renderings.values():
      c, _, _ = self.router(r)
      self.assertEqual(c.spec["command"][0], "/usr/sbin/nginx", c.what)
      self.assertTrue(c.spec["image"].startswith("kvwire-router:"), c.what)
    # The names exist in Debian 12 (where apt's package lists are present).
    unknown = debian_packages_missing(build_pkgs | runtime | set(apt_packages(router)))
    if unknown is None:
      print("note: apt's package lists are absent; Debian package names not looked up",
            file=sys.stderr)
    else:
      self.assertFalse(unknown, "%s: Debian has no package %s" % (path, sorted(unknown)))

  # -- the OpenAI-compatible front -------------------------------------------------------------

  def test_openai_front(self):
    """Its Deployment, Service, probes and route to the router in every rendering; flags the
    server takes; the decode NetworkPolicy lets it (and the router) in; the image's layout."""
    front_binary = os.path.join(BUILD, "openai_front", "kvwire-openai")
    help_text = subprocess.run([front_binary, "--help"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, check=False)
    self.assertEqual(help_text.returncode, 0, help_text.stdout)
    # The image's layout, which the manifests name.
    path = os.path.join(REPO, "deploy", "docker", "Dockerfile")
    stages = dockerfile_stages(path)
    names = [st[1] for st in stages]
    self.assertIn("openai", names, path)
    image, _, steps = stages[names.index("openai")]
    copied = {}  # file name -> where the openai stage puts it
    for k, t in steps:
      if k == "COPY":
        words = [w for w in t.split() if not w.startswith("--from")]
        for src in words[:-1]:
          copied[os.path.basename(src)] = words[-1].rstrip("/")
    for r in self.renderings.values():
      with self.subTest(rendering=r.name):
        self.assertIn("kvwire-openai", r.kind("Deployment"), r.name)
        fronts = [c for c in r.containers() if c.owner["metadata"]["name"] == "kvwire-openai"]
        self.assertEqual(len(fronts), 1, r.name)
        c = fronts[0]
        self.assertEqual(c.argv[0], os.path.join(copied.get("kvwire-openai", "(not copied)"),
                                                 "kvwire-openai"), c.what)
        self.assertTrue(c.spec["image"].startswith("kvwire-openai:"), c.what)
        flags = flag_map(c.argv[1:])
        for name in flags:
          self.assertIn("--" + name, help_text.stdout, "%s: kvwire-openai has no --%s" %
                        (c.what, name))
        # Its embedded Python finds chat_template.py where the image puts it.
        self.assertEqual(flags.get("python-dir"), copied.get("chat_template.py"), c.what)
        listen = port_of(flags["listen"], c.what + " --listen")
        self.assertEqual(c.port("http"), listen, c.what)
        for probe, path in (("readinessProbe", "/health"), ("livenessProbe", "/health/live")):
          spec = c.spec.get(probe, {}).get("httpGet", {})
          self.assertEqual(spec.get("path"), path, "%s: %s" % (c.what, probe))
          self.assertEqual(spec.get("port"), "http", "%s: %s" % (c.what, probe))
        services = r.services_for(c.pod)
        self.assertEqual([s["metadata"]["name"] for s in services], ["kvwire-openai"], c.what)
        self.assertEqual(services[0]["spec"]["ports"][0]["targetPort"], "http", c.what)
        # --target names the router's Service and port.
        host, port = flags["target"].rsplit(":", 1)
        self.assertIn(host, r.kind("Service"), "%s: --target %s is no Service" % (c.what, host))
        self.assertIn(int(port), [p["port"] for p in r.kind("Service")[host]["spec"]["ports"]],
                      "%s: Service %s has no port %s" % (c.what, host, port))
        router_pod = r.kind("Deployment")["kvwire-router"]["spec"]["template"]
        self.assertIn(host, [s["metadata"]["name"] for s in r.services_for(router_pod)], c.what)
        # The chat template comes from the model folder on the read-only model volume.
        model = flags["model"]
        self.assertEqual(model, self.renderings[r.name].nodes("decode")[0].flag("model"), c.what)
        if not model.startswith("synthetic:"):
          self.assertIs(c.mounts().get("/models", {}).get("readOnly"), True, c.what)
        grace = c.pod["spec"].get("terminationGracePeriodSeconds", 30)
        self.assertGreater(grace, self.prestop_seconds(c) + float(flags["grace-s"]), c.what)
        # The decode pods take Generate calls from the router and from the front.
        policy = r.kind("NetworkPolicy").get("kvwire-decode")
        self.assertTrue(policy, "%s: no NetworkPolicy kvwire-decode" % r.name)
        decode = r.nodes("decode")[0]
        self.assertTrue(selects(policy["spec"]["podSelector"]["matchLabels"],
                                decode.pod["metadata"]["labels"]), r.name)
        grpc_port = port_of(decode.flag("listen"), decode.what)
        metrics_port = port_of(decode.flag("metrics-listen"), decode.what)
        allowed = set()
        open_ports = set()
        for rule in policy["spec"]["ingress"]:
          ports = {p["port"] for p in rule.get("ports", [])}
          if not rule.get("from"):
            open_ports |= ports
            continue
          for peer in rule["from"]:
            for owner, pod in r.workloads():
              if selects(peer.get("podSelector", {}).get("matchLabels", {}),
                         pod["metadata"]["labels"]) and grpc_port in ports:
                allowed.add(owner["metadata"]["name"])
        self.assertEqual(allowed, {"kvwire-router", "kvwire-openai"}, r.name)
        self.assertEqual(open_ports, {metrics_port}, r.name)
    # The image: the packages of the libraries kvwire-openai links, and the jinja2 its
    # embedded Python renders chat templates with.
    self.assertEqual(image, "debian:12-slim", path)
    packages = set(apt_packages(steps))
    self.assertIn("python3-jinja2", packages, path)
    self.assertFalse(packages - install_deps_packages() - {"ca-certificates"} -
                     self.front_runtime_packages(front_binary), path)
    for pkg in self.front_runtime_packages(front_binary):
      self.assertIn(pkg, packages, "%s: kvwire-openai links a library of %s, which the openai "
                    "stage does not install" % (path, pkg))
    self.assertTrue([t for k, t in steps if k == "USER" and t.startswith("10001")], path)
    with open(os.path.join(REPO, "deploy", "docker", "Dockerfile.dockerignore")) as f:
      ignore = f.read().split()
    self.assertIn("!openai_front", ignore, "the build context lacks openai_front")

  @staticmethod
  def front_runtime_packages(binary):
    libs = needed_libraries(binary)
    owners = packages_of(libs.values())
    return {owners[p] for p in libs.values() if owners[p] and owners[p] not in
            BASE_IMAGE_PACKAGES}

  def test_dockerfile_gpu(self):
    path = os.path.join(REPO, "deploy", "docker", "Dockerfile.gpu")
    stages = dockerfile_stages(path)
    self.check_build_stage(path, stages[0], r"^nvidia/cuda:13\.\d+\.\d+-devel-ubuntu24\.04$")
    run = " ".join(t for k, t in stages[0][2] if k == "RUN")
    self.assertNotIn("-DKVWIRE_CUDA=OFF", run, path)
    runtime = set(self.check_runtime_stage(path, stages[-1],
                                           r"^nvidia/cuda:13\.\d+\.\d+-runtime-ubuntu24\.04$"))
    needed, _ = self.runtime_packages()
    for pkg, sonames in sorted(needed.items()):
      # Ubuntu 24.04's names: Debian 12's, or with the t64 suffix of the time_t transition.
      self.assertTrue({pkg, pkg + "t64"} & runtime, "%s: the binaries link %s (Debian: %s); the "
                      "runtime stage installs neither %s nor %st64" % (path, sorted(sonames),
                                                                       pkg, pkg, pkg))


def main():
  global REPO, BUILD
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--repo-root", required=True)
  p.add_argument("--build-dir", required=True)
  args, rest = p.parse_known_args()
  REPO, BUILD = os.path.abspath(args.repo_root), os.path.abspath(args.build_dir)
  if not find_kubectl():
    print("SKIP: kubectl is not installed; the Kubernetes manifests were not rendered")
    return 0
  if yaml is None:
    print("SKIP: python3-yaml is not installed (Debian: apt-get install python3-yaml); the "
          "Kubernetes manifests were not checked")
    return 0
  prog = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
  return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
  sys.exit(main())
