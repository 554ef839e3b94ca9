package agent

import (
	"context"
	"maps"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cmd/internal/servicedef"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// FileMetaKey is the meta key of an instance the agent registered from
// its services directory: the definition file's name. An instance of this
// node with it whose file left the directory is deregistered, after a
// restart too (cmd/internal/agent/DESIGN.md, "Service checks").
const FileMetaKey = "pivirt-services-file"

// runServicesDir registers the definitions of service_discovery.services_dir
// at start and again on every reload; a pass that could not write
// everything (no leader yet) is tried again, backing off to a minute.
func (a *Agent) runServicesDir() error {
	a.wg.Go(func() {
		var retry time.Duration
		for {
			done := a.syncServicesDir(a.ctx)
			var wait <-chan time.Time
			if !done {
				retry = min(max(2*retry, time.Second), time.Minute)
				wait = time.After(retry)
			} else {
				retry = 0
			}
			select {
			case <-a.ctx.Done():
				return
			case <-a.servicesKick:
			case <-wait:
			}
		}
	})
	return nil
}

// syncServicesDir registers every good definition of the directory for
// this node and deregisters this node's instances from files that are
// gone (or now define another instance). A bad file is logged with its
// error and its instance, if any, left as it is. It reports whether
// everything was written.
func (a *Agent) syncServicesDir(ctx context.Context) (done bool) {
	dir := a.current.Load().ServiceDiscovery.ServicesDir
	var (
		files []servicedef.File
		errs  []*servicedef.FileError
		err   error
	)
	if dir != "" {
		files, errs, err = servicedef.ReadDir(dir)
		if err != nil {
			// Nothing is deregistered for a directory that cannot be read.
			a.logger.Error("service_discovery.services_dir: cannot read the directory; its services stay as they are", "dir", dir, "error", err)
			return true
		}
	}
	self := a.cfg.NodeName
	bad := map[string]bool{} // files whose instance stays as it is
	for _, e := range errs {
		bad[e.Name] = true
		a.logger.Error("service_discovery.services_dir: a service definition was skipped; fix the file and reload", "error", e)
	}
	done = true
	wanted := map[checkKey]bool{}
	for _, f := range files {
		inst := f.Instance
		inst.Node = self
		meta := maps.Clone(inst.GetMeta())
		if meta == nil {
			meta = map[string]string{}
		}
		meta[FileMetaKey] = f.Name
		inst.Meta = meta
		rctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		resp, err := a.api.RegisterService(rctx, connect.NewRequest(&clusterv1.RegisterServiceRequest{Instance: inst}))
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return false
			}
			bad[f.Name] = true
			if connect.CodeOf(err) == connect.CodeInvalidArgument {
				a.logger.Error("service_discovery.services_dir: a service definition was refused; fix the file and reload", "file", f.Name, "dir", dir, "error", err)
				continue
			}
			a.logger.Info("service_discovery.services_dir: registering a service failed; trying again soon", "file", f.Name, "error", err)
			done = false
			continue
		}
		got := resp.Msg.GetInstance()
		wanted[checkKey{got.GetService(), got.GetInstanceId()}] = true
	}
	var state checkState = a.fsm
	if a.etcdMode() {
		state = a.etcd
	}
	_, mine, err := state.State().ServicesByNode(self, nil)
	if err != nil {
		a.logger.Warn("service_discovery.services_dir: reading this node's instances failed", "error", err)
		return false
	}
	for _, inst := range mine {
		name, ok := inst.GetMeta()[FileMetaKey]
		if !ok || bad[name] || wanted[checkKey{inst.GetService(), inst.GetInstanceId()}] {
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		_, err := a.api.DeregisterService(rctx, connect.NewRequest(&clusterv1.DeregisterServiceRequest{Service: inst.GetService(), InstanceId: inst.GetInstanceId()}))
		cancel()
		if err != nil && connect.CodeOf(err) != connect.CodeNotFound {
			if ctx.Err() == nil {
				a.logger.Info("service_discovery.services_dir: deregistering a service whose file is gone failed; trying again soon", "file", name, "error", err)
			}
			done = false
			continue
		}
		a.logger.Info("service_discovery.services_dir: deregistered a service whose file left the directory", "file", name, "service", inst.GetService(), "instance", inst.GetInstanceId())
	}
	return done
}
