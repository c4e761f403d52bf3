// etcd for the test cluster, built from the etcd server module that k8s.io/kubernetes v1.37.2 pins.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
