#!/usr/bin/env python3
"""scripts/make_certs.sh with the real openssl, in a temporary directory:

  * the files (ca.crt ca.key, prefill/ and decode/ with tls.crt tls.key ca.crt), keys mode 600
    and ECDSA P-256;
  * the prefill certificate: serverAuth only, its SANs the names asked for plus localhost and
    127.0.0.1; the decode certificate: clientAuth only; both verify against the CA;
  * a second run keeps every file as it is; --force reissues the node certificates under the
    same CA; --new-ca replaces the CA too;
  * what cannot be kept (a name the certificate lacks, half a key pair) and bad arguments are
    errors that say what to do, and change nothing.

Prints "SKIP: ..." and exits 0 when openssl is not installed.

usage: make_certs_test.py --repo-root DIR [unittest options]
"""
import argparse
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import unittest

REPO = ""


def openssl(*args):
  return subprocess.run(["openssl"] + list(args), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, check=True).stdout


class MakeCertsTest(unittest.TestCase):

  def setUp(self):
    self.tmp = tempfile.mkdtemp(prefix="kvwire-certs-test-")
    self.addCleanup(shutil.rmtree, self.tmp, True)
    self.out = os.path.join(self.tmp, "certs")

  def make(self, *args, ok=True):
    r = subprocess.run([os.path.join(REPO, "scripts", "make_certs.sh")] + list(args),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    if ok:
      self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    else:
      self.assertNotEqual(r.returncode, 0, r.stdout)
    return r

  def path(self, *parts):
    return os.path.join(self.out, *parts)

  def snapshot(self):
    files = {}
    for root, _, names in os.walk(self.out):
      for n in names:
        with open(os.path.join(root, n), "rb") as f:
          files[os.path.relpath(os.path.join(root, n), self.out)] = f.read()
    return files

  def test_files_keys_and_certificates(self):
    self.make(self.out, "--prefill-names", "kvwire-prefill,10.1.2.3", "--days", "30")
    self.assertEqual(sorted(self.snapshot()), [
        "ca.crt", "ca.key", "decode/ca.crt", "decode/tls.crt", "decode/tls.key",
        "prefill/ca.crt", "prefill/tls.crt", "prefill/tls.key"])
    for key in ("ca.key", "prefill/tls.key", "decode/tls.key"):
      mode = stat.S_IMODE(os.stat(self.path(key)).st_mode)
      self.assertEqual(mode, 0o600, "%s has mode %o" % (key, mode))
      self.assertIn("prime256v1", openssl("pkey", "-in", self.path(key), "-noout", "-text"))
    for ident in ("prefill", "decode"):
      with open(self.path("ca.crt"), "rb") as a, open(self.path(ident, "ca.crt"), "rb") as b:
        self.assertEqual(a.read(), b.read(), ident + "/ca.crt is not the CA")
      self.assertIn(": OK", openssl("verify", "-CAfile", self.path("ca.crt"),
                                    self.path(ident, "tls.crt")))
    prefill = openssl("x509", "-in", self.path("prefill", "tls.crt"), "-noout", "-ext",
                      "subjectAltName,extendedKeyUsage,basicConstraints")
    for name in ("DNS:kvwire-prefill", "DNS:localhost", "IP Address:10.1.2.3",
                 "IP Address:127.0.0.1", "TLS Web Server Authentication", "CA:FALSE"):
      self.assertIn(name, prefill)
    self.assertNotIn("Client Authentication", prefill)
    decode = openssl("x509", "-in", self.path("decode", "tls.crt"), "-noout", "-ext",
                     "extendedKeyUsage,basicConstraints")
    self.assertIn("TLS Web Client Authentication", decode)
    self.assertNotIn("Server Authentication", decode)
    ca = openssl("x509", "-in", self.path("ca.crt"), "-noout", "-ext", "basicConstraints")
    self.assertIn("CA:TRUE", ca)
    # --days 30: the node certificates end within 31 days, the CA's much later.
    day = 86400
    for ident in ("prefill", "decode"):
      end = subprocess.run(["openssl", "x509", "-in", self.path(ident, "tls.crt"), "-noout",
                            "-checkend", str(31 * day)], stdout=subprocess.DEVNULL)
      self.assertNotEqual(end.returncode, 0, ident + ": valid for more than --days 30")
    ca_end = subprocess.run(["openssl", "x509", "-in", self.path("ca.crt"), "-noout",
                             "-checkend", str(3000 * day)], stdout=subprocess.DEVNULL)
    self.assertEqual(ca_end.returncode, 0, "the CA is valid for less than 3000 days")

  def test_keeps_what_exists_and_rotates_on_request(self):
    self.make(self.out, "--prefill-names", "kvwire-prefill")
    first = self.snapshot()
    r = self.make(self.out, "--prefill-names", "kvwire-prefill")
    self.assertIn("kept", r.stdout)
    self.assertEqual(self.snapshot(), first, "a second run changed files")
    self.make(self.out)  # no names: localhost and 127.0.0.1 only, which it has
    self.assertEqual(self.snapshot(), first)

    self.make(self.out, "--force", "--prefill-names", "kvwire-prefill")
    forced = self.snapshot()
    for same in ("ca.crt", "ca.key", "prefill/ca.crt", "decode/ca.crt"):
      self.assertEqual(forced[same], first[same], "--force changed " + same)
    for new in ("prefill/tls.crt", "prefill/tls.key", "decode/tls.crt", "decode/tls.key"):
      self.assertNotEqual(forced[new], first[new], "--force kept " + new)

    self.make(self.out, "--new-ca")
    renewed = self.snapshot()
    for new in ("ca.crt", "ca.key", "prefill/tls.crt", "decode/tls.crt", "decode/ca.crt"):
      self.assertNotEqual(renewed[new], forced[new], "--new-ca kept " + new)
    self.assertIn(": OK", openssl("verify", "-CAfile", self.path("ca.crt"),
                                  self.path("decode", "tls.crt")))

  def test_what_cannot_be_kept_is_an_error(self):
    self.make(self.out)
    before = self.snapshot()
    r = self.make(self.out, "--prefill-names", "kvwire-prefill", ok=False)
    self.assertIn("does not name kvwire-prefill", r.stderr)
    self.assertIn("--force", r.stderr)
    self.assertEqual(self.snapshot(), before)
    os.remove(self.path("decode", "tls.key"))
    r = self.make(self.out, ok=False)
    self.assertIn("not both", r.stderr)
    os.remove(self.path("ca.key"))
    r = self.make(self.out, ok=False)
    self.assertIn("--new-ca", r.stderr)

  def test_bad_arguments(self):
    for args, message in ((["--days", "0", self.out], "--days"),
                          ([self.out, "--prefill-names", "bad name!"], "neither a DNS name"),
                          ([self.out, "--prefill-names", "a,,b"], "empty name"),
                          ([], "OUT_DIR is missing"),
                          ([self.out, "--frobnicate"], "unknown option")):
      with self.subTest(args=args):
        r = self.make(*args, ok=False)
        self.assertIn(message, r.stderr)
    self.assertFalse(os.path.exists(self.out), "a refused run created files")


def main():
  global REPO
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--repo-root", required=True)
  args, rest = p.parse_known_args()
  REPO = os.path.abspath(args.repo_root)
  if not shutil.which("openssl"):
    print("SKIP: openssl is not installed (Debian: apt-get install openssl)")
    return 0
  prog = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
  return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
  sys.exit(main())
