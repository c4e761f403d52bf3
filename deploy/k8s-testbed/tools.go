//go:build tools

// The control-plane commands this module builds, as packages of its dependencies:
//
//	go build -o BIN k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
//	    k8s.io/kubernetes/cmd/kube-scheduler ./etcd
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
