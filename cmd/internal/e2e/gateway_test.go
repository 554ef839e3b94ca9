package e2e_test

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/identity"
)

// vmOut is a VM in pvcli's JSON.
type vmOut struct {
	ID         string `json:"id"`
	Name       string `json:"name"`
	PowerState string `json:"powerState"`
	Host       string `json:"host"`
	Metadata   struct {
		Owner string `json:"owner"`
	} `json:"metadata"`
}

// gatewayExamples drives the VM, volume and network APIs through node n to
// its pivirtd-sim with pvcli, and the spec's grpcurl commands.
func (c *cluster) gatewayExamples(t *testing.T, n *node) {
	var created struct {
		VM vmOut `json:"vm"`
	}
	c.okJSON(t, n, &created, "-o", "json", "vm", "create", "web-1", "--vcpus", "2", "--memory-mib", "2048", "--owner", "alice")
	vm := created.VM
	if vm.ID == "" || vm.PowerState != "POWER_STATE_STOPPED" || vm.Host != n.name || vm.Metadata.Owner != "alice" {
		t.Fatalf("vm create: %+v", vm)
	}
	var list struct {
		VMs []vmOut `json:"vms"`
	}
	c.okJSON(t, n, &list, "-o", "json", "vm", "list", "--owner", "alice")
	if len(list.VMs) != 1 || list.VMs[0].ID != vm.ID {
		t.Errorf("vm list --owner alice: %+v", list.VMs)
	}
	var started vmOut
	c.okJSON(t, n, &started, "-o", "json", "vm", "start", vm.ID)
	if started.PowerState != "POWER_STATE_RUNNING" {
		t.Errorf("vm start: %+v", started)
	}
	if r := c.pvcli(t, n, "vm", "delete", vm.ID); r.code != 1 || !strings.Contains(r.stderr, "power it off first") {
		t.Errorf("deleting a running VM: %s", r)
	}
	c.ok(t, n, "vm", "reboot", vm.ID)
	c.ok(t, n, "vm", "stop", vm.ID, "--shutdown-timeout", "5s")
	if r := c.pvcli(t, n, "vm", "reboot", vm.ID); r.code != 1 || !strings.Contains(r.stderr, "cannot reboot") {
		t.Errorf("rebooting a stopped VM: %s", r)
	}
	if r := c.pvcli(t, n, "vm", "get", "vm-missing"); r.code != 1 || !strings.Contains(r.stderr, `vm "vm-missing" not found`) {
		t.Errorf("vm get of a missing VM: %s", r)
	}
	if r := c.pvcli(t, n, "vm", "update", vm.ID); r.code != 2 || !strings.Contains(r.stderr, "nothing to update") {
		t.Errorf("vm update without flags: %s", r)
	}
	c.ok(t, n, "vm", "update", vm.ID, "--vcpus", "4", "--label", "tier=web")
	// watch prints the VMs that exist, then changes, until --timeout.
	w := c.ok(t, n, "vm", "watch", "--timeout", "2s")
	if !strings.Contains(w.stdout, "existing") || !strings.Contains(w.stdout, vm.ID) {
		t.Errorf("vm watch printed %q", w.stdout)
	}
	c.ok(t, n, "vm", "delete", vm.ID)

	// A volume and an upload streamed through the agent.
	var vol struct {
		Volume struct {
			ID           string `json:"id"`
			WrittenBytes string `json:"writtenBytes"`
			Sha256       string `json:"sha256"`
		} `json:"volume"`
	}
	c.okJSON(t, n, &vol, "-o", "json", "volume", "create", "disk-1", "--size", "1MiB")
	image := make([]byte, 300<<10)
	_, _ = rand.Read(image)
	imageFile := filepath.Join(t.TempDir(), "image.raw")
	if err := os.WriteFile(imageFile, image, 0o600); err != nil {
		t.Fatal(err)
	}
	c.okJSON(t, n, &vol, "-o", "json", "volume", "upload", vol.Volume.ID, imageFile)
	sum := sha256.Sum256(image)
	if vol.Volume.WrittenBytes != "307200" || vol.Volume.Sha256 != hex.EncodeToString(sum[:]) {
		t.Errorf("volume upload: %+v", vol.Volume)
	}
	if r := c.pvcli(t, n, "volume", "create", "disk-2", "--size", "lots"); r.code != 2 || !strings.Contains(r.stderr, `invalid --size "lots"`) {
		t.Errorf("volume create with a bad size: %s", r)
	}
	c.ok(t, n, "network", "create", "net-1", "--cidr", "10.10.0.0/24", "--vlan", "10")
	if r := c.pvcli(t, n, "network", "create", "net-2", "--cidr", "10.10.0.1/24"); r.code != 1 || !strings.Contains(r.stderr, "host bits set") {
		t.Errorf("network create with host bits: %s", r)
	}

	// grpcurl, as in the spec, with the operator's certificate.
	grpcurl := func(args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		defer cancel()
		base := []string{"-cacert", filepath.Join(c.certs, identity.ChainFile),
			"-cert", filepath.Join(c.certs, "operator.crt"), "-key", filepath.Join(c.certs, "operator.key")}
		out, err := exec.CommandContext(ctx, c.bins.grpcurl, append(base, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("grpcurl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	if out := grpcurl(n.api, "list"); !strings.Contains(out, "pivirt.vm.v1.VMService") || !strings.Contains(out, "grpc.health.v1.Health") {
		t.Errorf("grpcurl list:\n%s", out)
	}
	var listed struct {
		VMs []vmOut `json:"vms"`
	}
	out := grpcurl("-d", "{}", n.api, "pivirt.vm.v1.VMService/ListVMs")
	if err := json.Unmarshal([]byte(out), &listed); err != nil {
		t.Errorf("grpcurl ListVMs: %v\n%s", err, out)
	}
	if out := grpcurl("-d", `{"service": "pivirt.vm.v1.VMService"}`, n.api, "grpc.health.v1.Health/Check"); !strings.Contains(out, "SERVING") {
		t.Errorf("grpcurl health check of the VM API:\n%s", out)
	}
}
