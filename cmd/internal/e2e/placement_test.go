package e2e_test

import (
	"strings"
	"testing"
)

// placementExamples drives pvcli through every node at objects on every
// node (each node has a pivirtd-sim of its own): a VM, a volume and a
// network made on each node through another one with --host, then read,
// started and listed through every node; a VM made on a node no agent
// knows is refused.
func (c *cluster) placementExamples(t *testing.T) {
	nodes := c.nodes
	ids := map[string]string{} // VM ID → its node
	for i, host := range nodes {
		via := nodes[(i+1)%len(nodes)]
		var created struct {
			VM vmOut `json:"vm"`
		}
		c.okJSON(t, via, &created, "-o", "json", "vm", "create", "placed-"+host.name, "--vcpus", "1", "--memory-mib", "256", "--host", host.name)
		if created.VM.Host != host.name {
			t.Fatalf("vm create --host %s through %s made it on %q", host.name, via.name, created.VM.Host)
		}
		ids[created.VM.ID] = host.name
		var vol struct {
			Volume struct {
				Host string `json:"host"`
			} `json:"volume"`
		}
		c.okJSON(t, via, &vol, "-o", "json", "volume", "create", "placed-"+host.name, "--size", "1MiB", "--host", host.name)
		if vol.Volume.Host != host.name {
			t.Errorf("volume create --host %s made it on %q", host.name, vol.Volume.Host)
		}
	}
	if r := c.pvcli(t, nodes[0], "vm", "create", "nowhere", "--host", "node9"); r.code != 1 || !strings.Contains(r.stderr, "no such node") {
		t.Errorf("vm create --host node9: %s", r)
	}
	for i, n := range nodes {
		for id, host := range ids {
			var got struct {
				VM vmOut `json:"vm"`
			}
			c.okJSON(t, n, &got, "-o", "json", "vm", "get", id)
			if got.VM.Host != host {
				t.Errorf("vm get %s through %s: host %q, want %s", id, n.name, got.VM.Host, host)
			}
		}
		// Each VM started through a node other than its own, once.
		for id, host := range ids {
			if host == nodes[(i+1)%len(nodes)].name {
				var started vmOut
				c.okJSON(t, n, &started, "-o", "json", "vm", "start", id)
				if started.PowerState != "POWER_STATE_RUNNING" || started.Host != host {
					t.Errorf("vm start %s through %s: %+v", id, n.name, started)
				}
			}
		}
		var list struct {
			VMs []vmOut `json:"vms"`
		}
		c.okJSON(t, n, &list, "-o", "json", "vm", "list")
		seen := map[string]string{}
		for _, v := range list.VMs {
			seen[v.ID] = v.Host
		}
		for id, host := range ids {
			if seen[id] != host {
				t.Errorf("vm list through %s: %s on %q, want %s (listed %d VMs)", n.name, id, seen[id], host, len(list.VMs))
			}
		}
		out := c.ok(t, n, "vm", "list", "--host", nodes[0].name).stdout
		for id, host := range ids {
			if strings.Contains(out, id) != (host == nodes[0].name) {
				t.Errorf("vm list --host %s through %s: %q", nodes[0].name, n.name, out)
			}
		}
	}
	// Every VM's console through every node: its own simulator's shell
	// answers, and the shell's exit status is pvcli's.
	for _, n := range nodes {
		for id, host := range ids {
			r := c.pvcliInput(t, n, "hostname\nexit 7\n", "vm", "console", id)
			if r.code != 7 || !strings.Contains(r.stdout, "root@placed-"+host+":~# hostname\r\nplaced-"+host+"\r\n") {
				t.Errorf("vm console %s (on %s) through %s: %s\nwant the shell's answer and exit status 7", id, host, n.name, r)
			}
		}
	}
	var vols struct {
		Volumes []struct {
			Name string `json:"name"`
			Host string `json:"host"`
		} `json:"volumes"`
	}
	c.okJSON(t, nodes[0], &vols, "-o", "json", "volume", "list")
	placed := 0
	for _, v := range vols.Volumes {
		if strings.HasPrefix(v.Name, "placed-") {
			placed++
			if v.Name != "placed-"+v.Host {
				t.Errorf("volume list: %s on %q", v.Name, v.Host)
			}
		}
	}
	if placed != len(nodes) {
		t.Errorf("volume list through %s: %d placed volumes, want %d: %+v", nodes[0].name, placed, len(nodes), vols.Volumes)
	}
	// The watches print the objects of every node, then changes, until
	// --timeout.
	w := c.ok(t, nodes[1], "volume", "watch", "--timeout", "2s").stdout
	for _, host := range nodes {
		if !strings.Contains(w, "placed-"+host.name) {
			t.Errorf("volume watch through %s printed %q, want placed-%s", nodes[1].name, w, host.name)
		}
	}
	c.ok(t, nodes[0], "network", "create", "placed-net", "--cidr", "10.77.0.0/24", "--host", nodes[2].name)
	if w := c.ok(t, nodes[1], "network", "watch", "--timeout", "2s").stdout; !strings.Contains(w, "placed-net") || !strings.Contains(w, nodes[2].name) {
		t.Errorf("network watch through %s printed %q, want placed-net on %s", nodes[1].name, w, nodes[2].name)
	}
}
